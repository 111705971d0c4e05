"""Built-in tiny models: shipped in this folder, rebuilt by ``localrl models build NAME``.

A built-in model is a plain Hugging Face model directory; its name resolves to that
directory, and it is the default model when none is named. Importing this package imports
nothing else of localrl (the pretraining code, which needs torch and the task generator, load on demand).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT = "tiny-arith"
BUILTIN = ("tiny-arith", "tiny-arith-conf", "tiny-arith-verbose", "tiny-shell", "tiny-shell-world")  # each pretrained as build.py says


def builtin_names() -> list[str]:
    return sorted(BUILTIN)


def builtin_path(name: str) -> Path | None:
    """The directory of built-in model ``name``, or None if no such built-in exists."""
    return ROOT / name if name in BUILTIN else None
