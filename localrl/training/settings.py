"""A run's config assembled with its plug-ins: the selected objective's and environment's presets, and every
registered plug-in's checks of its own settings, above the registries (``localrl.config`` holds the fields and
checks its own; it imports no plug-in).

    build_config(file, overrides)   # defaults < env preset < objective preset < file < flags, the sampler the
                                    # data's columns select (typed_data), then check_config
    check_config(cfg)               # the config's own fields, the loss type the objective takes, each plug-in's,
                                    # and what the sampler needs of the objective (capabilities, not names)
    register_named(values)          # the user's plug-ins named package.module:function, so their settings read
    read_run_config(run)            # a run's saved config, its plug-ins registered
    plugins_help()                  # the registered plug-ins, a line each (localrl train -h)

Importing this module registers every built-in plug-in, and so makes their settings fields of ``TrainConfig``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from localrl.config import BUILTIN_TASKS, FIELDS, TrainConfig, check_fields
from localrl.config_io import config_values, read_toml
from localrl.data.dataset_types import refuse, source_type
from localrl.data.sources import Columns, is_missing
from localrl.envs import environments
from localrl.errors import UserError
from localrl.objectives import objectives
from localrl.policy.losses import LOSSES
from localrl.runs import Run
from localrl.samplers import sampler_for, samplers


def build_config(file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, the selected plug-ins' presets, then the TOML file, then overrides; checked (``check_config``)."""
    register_named({**(read_toml(file) if file else {}), **(overrides or {})})
    values = config_values(file, overrides)
    # the objective's preset first: it may choose the environment (unless the user gives data of their own: an
    # environment's tasks and a source's rows are the two kinds of prompts), whose preset then applies
    for k, v in objectives.preset(values.get("objective", FIELDS["objective"].default)).items():
        if not (k == "env" and "data" in values):
            values.setdefault(k, v)
    for k, v in environments.preset(values.get("env", FIELDS["env"].default)).items():
        values.setdefault(k, v)
    return check_config(typed_data(TrainConfig(**values)))


def typed_data(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the sampler its data's rows select: a source of one of TRL's dataset types that the sampler the
    config selects cannot read, and exactly one sampler that reads it and that the objective can train with (TRL too
    decides from the columns: ``--objective dpo --data prefs.jsonl`` reads the pairs). ``check_data_type`` says it
    when there is none."""
    if cfg.sampler:
        return cfg
    kind, reads = _data_type(cfg), sampler_for(cfg).reads
    if kind is None or not reads or kind in reads:  # (a sampler that declares no types: the user's own, unjudged)
        return cfg
    usable = _readers(kind, objectives.get(cfg.objective))
    return replace(cfg, sampler=usable[0]) if len(usable) == 1 else cfg


def check_data_type(cfg: TrainConfig) -> None:
    """Rows of a dataset type the run's sampler does not read are one line naming what would take them: the sampler
    to name, or the objectives that can train on them (``--objective dpo`` for preference pairs)."""
    kind, reads = _data_type(cfg), sampler_for(cfg).reads
    if kind is None or not reads or kind in reads:
        return
    objective = objectives.get(cfg.objective)
    usable = _readers(kind, objective)
    if usable:
        raise refuse(cfg.data, kind, f"sampler {samplers.selected(cfg)} does not read them; sampler {usable[0]} "
                                     f"does (--sampler {usable[0]})")
    able = sorted(name for name, o in objectives.items() if _readers(kind, o))
    raise refuse(cfg.data, kind, f"objective {cfg.objective} cannot train on them; " + (
        f"objectives that can: {', '.join(able)} (--objective {able[0]})" if able else
        "no objective here takes them"))


def _data_type(cfg: TrainConfig) -> str | None:
    """The dataset type of the run's data source (None: an environment's tasks, a built-in task, a source that is
    not there, or rows under other column names)."""
    if cfg.env or cfg.data in BUILTIN_TASKS or is_missing(cfg.data):
        return None
    return source_type(cfg.data, Columns.of(cfg))


def _readers(kind: str, objective) -> list[str]:
    """The samplers that read rows of ``kind`` and hand them to an objective that can train with them."""
    return sorted(name for name, s in samplers.items() if kind in s.reads and
                  all(getattr(objective, capability, False) for capability in s.needs))


def register_named(values: dict[str, Any]) -> None:
    """Import and register the plug-ins ``values`` name as ``package.module:function`` (an objective, sampler or
    environment of the user's own), so that their settings are config fields before the other values are read."""
    for registry in (objectives, samplers, environments):
        name = values.get(registry.field)
        if isinstance(name, str) and ":" in name:
            registry.resolve(name)


def read_run_config(run: Run, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A run's saved config (``Run.read_config``), the user's plug-ins it names registered first."""
    register_named(read_toml(run.config_path) if run.config_path.is_file() else {})
    return run.read_config(overrides)


def plugins_help() -> str:
    """The registered objectives, samplers and environments, what each is in a line (``localrl train -h``)."""
    lines = []
    for registry in (objectives, samplers, environments):
        lines.append(f"{registry.kind}s (--{registry.field.replace('_', '-')} NAME, or package.module:function):")
        lines += [f"  {name:<34} {about}" for name, about in registry.listing()]
        lines.append("")
    return "\n".join(lines)


def check_config(cfg: TrainConfig) -> TrainConfig:
    """Raise UserError naming the first impossible setting: the config's own fields (``TrainConfig.validate``),
    the plug-ins it names, the loss type its objective takes, and each registered plug-in's own settings and the
    combinations it cannot run with (``localrl.registry``); returns ``cfg``."""
    cfg.validate()
    check_fields(cfg, [
        ("sampler", not cfg.sampler or samplers.known(cfg.sampler),
         f"must be empty or one of {', '.join(samplers.names())} (or package.module:Class)"),
        ("env", not cfg.env or environments.known(cfg.env),
         f"must be empty or one of {', '.join(environments.names())} (or package.module:function)"),
    ])
    # the loss types the objective takes (GRPO's family, unless the objective declares its own: dpo's, which may
    # name several, comma-separated, as TRL's DPOConfig takes a list)
    objective = dict(objectives.items()).get(cfg.objective)
    loss_types = getattr(objective, "loss_types", None) or tuple(LOSSES)
    several = getattr(objective, "combines_losses", False)
    named = cfg.loss_type.split(",") if several else [cfg.loss_type]
    check_fields(cfg, [("loss_type", all(n.strip() in loss_types for n in named),
                        f"must be one of {', '.join(loss_types)} for objective {cfg.objective}" + (
                            " (or several, comma-separated)" if several else ""))])
    for registry in (objectives, samplers, environments):
        registry.check_settings(cfg)
    check_data_type(cfg)
    check_capabilities(cfg)
    return cfg


def check_capabilities(cfg: TrainConfig) -> None:
    """The objective can train on what the sampler hands it: each capability the sampler ``needs`` is one the
    objective declares (``Objective.samples``, ``group_relative``, ``takes_pairs``), asked of the plug-ins, never
    of their names."""
    sampler, objective = sampler_for(cfg), objectives.get(cfg.objective)
    for capability, why in getattr(sampler, "needs", {}).items():
        if not getattr(objective, capability, False):
            able = sorted(n for n, o in objectives.items() if getattr(o, capability, False))
            raise UserError(f"config field objective: {cfg.objective} cannot train with sampler "
                            f"{samplers.selected(cfg)} ({why}; "
                            f"objectives that can: {', '.join(able) or 'none'})", field="objective")


# Every built-in plug-in registered now, as this module is imported: their settings are fields of TrainConfig
# before any config is read or made (``from localrl import TrainConfig`` comes through here)
for _registry in (objectives, samplers, environments):
    _registry.names()
