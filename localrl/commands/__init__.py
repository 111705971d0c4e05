"""One module per ``localrl`` command (a command's flags checked, the library called, the result printed);
``localrl.cli`` parses the command line and dispatches here. Helpers every command shares are below. No command
imports the CLI or the terminal UI."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from localrl.errors import UserError


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging
    import warnings

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # optional-kernel notices on every import
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # per-retry network noise
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def config_fields(taken: list[str] | None, argv: list[str] = ()) -> list[str]:
    """The config fields a command takes as flags: ``taken``, or (None) every field, the plug-ins' settings
    included. Those are registered as a run's config is assembled (``localrl.training.settings``, imported only
    here: it imports torch), a plug-in that ``argv`` or its --config file names as ``package.module:function``
    first, so that its flags parse."""
    from localrl.config import FIELDS
    from localrl.config_io import read_toml, split_overrides
    from localrl.training.settings import register_named

    named, rest = split_overrides(list(argv), ["objective", "sampler", "env"])
    config = next((rest[i + 1] if a == "--config" else a.partition("=")[2] for i, a in enumerate(rest)
                   if (a == "--config" and i + 1 < len(rest)) or a.startswith("--config=")), None)
    register_named({**(read_toml(config) if config else {}), **named})
    return list(FIELDS) if taken is None else taken


def plugins_help() -> str:
    """The registered objectives, samplers and environments, a line each (``localrl train -h``)."""
    from localrl.training.settings import plugins_help as listing

    return listing()


def main_rank() -> bool:
    """Whether this process speaks for the run: always, unless torchrun launched it as a rank other than 0."""
    return int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("RANK", "0") == "0"


def check_png_path(path: str, what: str) -> None:
    """A PNG to be written after minutes of work: refuse a path that cannot be one before starting."""
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise UserError(f"{what} {path}: must be a .png file")
    if out.is_dir():
        raise UserError(f"{what} {path}: is a directory")
    if not out.parent.is_dir():
        raise UserError(f"{what} {path}: no such directory {out.parent}")


def one_line(text, width: int = 200) -> str:
    text = text if isinstance(text, str) else " | ".join(m["content"] for m in text)
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def replaceable_dir(out: Path, command: str, markers: tuple[str, ...], what: str) -> Path:
    """``out`` for a command that replaces it whole: refused if it is a file, or a directory with files but
    without any of ``markers`` (the files that say the command wrote it)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{command} --out {out}: is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not any((out / m).is_file() for m in markers):
        raise UserError(f"{command} --out {out}: holds files that are not {what}; it would replace "
                        f"them (choose an empty or new directory)")
    parent = out.absolute().parent
    try:  # the directory is written beside it first, then renamed into place: a place that takes none stops here
        os.rmdir(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=parent))
    except OSError as e:
        raise UserError(f"{command} --out {out}: cannot write in {parent} ({e.strerror or e})") from None
    return out
