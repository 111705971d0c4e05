"""Every built-in model's recipe, by name: ``localrl models build NAME`` runs it."""

from __future__ import annotations

from pathlib import Path

from localrl.models.recipe import Recipe, arith_data, pretrain
from localrl.models.shell_recipe import ShellRecipe, shell_data

RECIPES: dict[str, Recipe] = {
    "tiny-arith": Recipe(),
    "tiny-arith-conf": Recipe(confidence=True),
    "tiny-arith-verbose": Recipe(restate=0.5),
    "tiny-shell": ShellRecipe(steps=5000, batch_size=32, max_positions=512, corpus_tasks=6000),
}


def build(out_dir: str | Path, recipe: Recipe, log=print) -> Path:
    """Pretrain ``recipe`` into ``out_dir`` (atomically)."""
    return pretrain(out_dir, recipe, shell_data if isinstance(recipe, ShellRecipe) else arith_data, log)
