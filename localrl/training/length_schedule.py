"""The completion budget of each step: a curriculum that shrinks (or holds) ``max_new_tokens`` over a run.

Curriculum GRPO's recipe: start with room to think and tighten the budget, so the model learns to reach
the same answers in shorter traces. ``constant`` keeps ``max_new_tokens``; ``linear`` goes from it at the
first step to ``max_new_tokens_final`` at the last, rounded to whole tokens; ``step`` cuts the run into
``budget_stages`` equal stages whose budgets fall in equal steps between the two. The step's budget
is what its rollouts may generate, the length the overlong punishment and dr_grpo's normaliser measure
against, and what the memory plan assumes; the held-out evaluations use ``max_new_tokens``.
"""

from __future__ import annotations

from localrl.config import TrainConfig


def max_tokens_at(cfg: TrainConfig, step: int) -> int:
    """``max_new_tokens`` for step ``step`` (0-based) of ``cfg.steps``."""
    start = cfg.max_new_tokens
    final = cfg.max_new_tokens_final or start
    if cfg.budget_schedule == "constant" or final == start or cfg.steps == 1:
        return start
    if cfg.budget_schedule == "linear":
        return round(start + (final - start) * step / (cfg.steps - 1))
    stage = min(step * cfg.budget_stages // cfg.steps, cfg.budget_stages - 1)  # step: 0 .. stages-1
    return round(start + (final - start) * stage / (cfg.budget_stages - 1))
