"""Built-in tiny models: shipped in this folder, rebuilt by ``localrl models build NAME``.

A built-in model is a plain Hugging Face model directory; its name resolves to that
directory, and it is the default model when none is named.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT = "tiny-arith"


def builtin_names() -> list[str]:
    from models.recipe import RECIPES

    return sorted(RECIPES)


def builtin_path(name: str) -> Path | None:
    """The directory of built-in model ``name``, or None if no such built-in exists."""
    return ROOT / name if name in builtin_names() else None
