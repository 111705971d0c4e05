"""A TrainConfig as users write it: ``--field value`` flags (the CLI and the terminal UI), TOML files (top level or a
[train] table; the resolved config a run saves), and the ``localrl train -h`` listing of every field by group, each
plug-in's settings under its own heading. Values are converted to the field's type here, each bad one a
``UserError`` naming the field."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from localrl.config import FIELDS, TrainConfig, plugin_settings
from localrl.errors import UserError


def coerce(name: str, value: Any, where: str = "") -> Any:
    """Convert ``value`` (a TOML value or a command-line string) to the type of field ``name``."""
    if name not in FIELDS:
        raise UserError(f"{where}unknown config field {name!r}", field=name)
    kind = type(FIELDS[name].default)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif kind is str and isinstance(value, str):
        return value
    elif isinstance(value, str) and kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise UserError(f"{where}config field {name}: expected {kind.__name__}, got {value!r}", field=name)


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


_BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")
FLAG_ALIASES = {"--4bit": ("quantize", "nf4"), "--no-4bit": ("quantize", "none")}  # flag -> (field, value)
LEGACY_FIELDS = {"load_in_4bit": ("quantize", {True: "nf4", False: "none"})}  # in run configs written before


def split_overrides(argv: list[str], allowed: list[str] | None = None) -> tuple[dict[str, Any], list[str]]:
    """(config fields set by flags in ``argv``, the other arguments in order).

    Flags: ``--field value``, ``--field=value``, and for booleans ``--field`` / ``--no-field``
    (``--4bit`` / ``--no-4bit`` for load_in_4bit), or ``--field true|false``. Later flags win.
    Only ``allowed`` fields (default: all) are read; values are converted and type-checked.
    """
    names = {flag_name(n): n for n in (allowed if allowed is not None else FIELDS)}
    out: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in FLAG_ALIASES and FLAG_ALIASES[arg][0] in names.values():
            field, value = FLAG_ALIASES[arg]
            out[field] = value
            i += 1
            continue
        flag, eq, value = arg.partition("=")
        negated = flag.startswith("--no-") and "--" + flag[len("--no-"):] in names
        name = names.get("--" + flag[len("--no-"):] if negated else flag)
        i += 1
        if name is None:
            rest.append(arg)
            continue
        if type(FIELDS[name].default) is bool and not eq:
            if not negated and i < len(argv) and argv[i].lower() in _BOOL_WORDS:
                out[name] = coerce(name, argv[i])
                i += 1
            else:
                out[name] = not negated
            continue
        if negated:
            raise UserError(f"flag {flag}: {name} is not a yes/no field", field=name)
        if not eq:
            if i == len(argv):
                raise UserError(f"flag {flag}: needs a value", field=name)
            value = argv[i]
            i += 1
        out[name] = coerce(name, value)
    return out, rest


def parse_overrides(argv: list[str], allowed: list[str] | None = None) -> dict[str, Any]:
    """Config fields from flags (see ``split_overrides``); anything else is an error naming it."""
    out, rest = split_overrides(argv, allowed)
    if rest:
        guess = rest[0].partition("=")[0].lstrip("-").replace("-", "_")
        known = guess in FIELDS
        raise UserError(f"unknown flag {rest[0]!r}" + (" (that config field cannot be set here)" if known else
                                                       " (config fields are set with --field-name value)"),
                        field=guess if known else None)
    return out


# ``localrl train -h`` groups the fields, as TRL's config docs do: (heading, the group's first field), in field order;
# each plug-in's settings follow, under their own headings (``add_settings``)
HELP_SECTIONS = [("what to train: model, data, rewards", "model"), ("model and adapter; the objective", "quantize"),
                 ("the step: prompts, group, completion budget", "steps"),
                 ("sampling: the sampler; prompt completions (torch or llama.cpp)", "sampler"),
                 ("the policy loss (TRL's names and defaults)", "num_iterations"), ("KL to the reference", "beta"),
                 ("optimiser and memory", "lr"), ("agent training (--env)", "env"),
                 ("evaluation, checkpoints, the run", "eval_size")]


def fields_help(only: list[str] | None = None) -> str:
    """One line per config field (or each of ``only``), grouped under ``HELP_SECTIONS``, for ``localrl train -h``."""
    starts = {first: heading for heading, first in HELP_SECTIONS} | {
        dataclasses.fields(settings)[0].name: heading for heading, settings in plugin_settings()}
    lines, heading, shown = [], None, None
    for name, f in FIELDS.items():
        heading = starts.get(name, heading)
        if only is not None and name not in only:
            continue
        if heading != shown:
            lines.append(f"{'' if not lines else chr(10)}{heading}:")
            shown = heading
        flag = flag_name(name) + ("/--no-" + name.replace("_", "-") if type(f.default) is bool else " VALUE")
        lines.append(f"  {flag:<34} {f.metadata['help']} (default: {f.default!r})")
    return "\n".join(lines)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Field values from a TOML file (top level, or a [train] table), type-checked."""
    return {k: coerce(k, v, f"{path}: ") for k, v in read_toml(path).items()}


def read_toml(path: str | Path) -> dict[str, Any]:
    """The fields a TOML file sets (top level, or a [train] table), as the file has them."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {p}: " + ("is a directory" if p.is_dir() else "not found"))
    try:
        data = p.read_bytes()
    except OSError as e:
        raise UserError(f"config file {p}: cannot be read ({e.strerror})") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark, as some Windows editors write, is no mistake
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{p}:{line}: not UTF-8 text (byte {data[e.start]:#04x}); TOML files are UTF-8") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {p}: invalid TOML ({e})") from None
    if "train" in raw:
        if not isinstance(raw["train"], dict):
            raise UserError(f"config file {p}: 'train' must be a [train] table of fields (got {raw['train']!r})")
        others = [k for k in raw if k != "train"]
        if others:  # which would win is a guess either way: one place for every field
            raise UserError(f"config file {p}: has fields both at the top level ({', '.join(others)}) and in a "
                            f"[train] table; put them all in one place")
        raw = raw["train"]
    for old, (new, values) in LEGACY_FIELDS.items():
        if old in raw and new not in raw and raw[old] in values:
            raw[new] = values[raw.pop(old)]
    return raw


def config_values(file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields a TOML file sets, then ``overrides``, type-checked (the defaults and presets not applied)."""
    values: dict[str, Any] = dict(load_toml(file)) if file else {}
    for k, v in (overrides or {}).items():
        values[k] = coerce(k, v)
    return values


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML, one commented line per field."""
    lines = ["# localrl resolved run config", "[train]"]
    for name, f in FIELDS.items():
        value = getattr(cfg, name)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:
            text = repr(value)
        lines.append(f"{name} = {text}  # {f.metadata['help']}")
    return "\n".join(lines) + "\n"
