"""GRPO over any sampler: a step samples a scored batch (prompt completions, Markovian traces or an
environment's episodes), then updates the adapter on it (``localrl.policy.grpo.update``: group-relative
advantages, the clipped loss of the configured type, + beta x KL to the reference, ``num_iterations``
AdamW steps). With beta 0, groups whose completions all scored alike are left out of the update (their
gradient is exactly zero); a step in which every group did updates nothing.

Its state through a run (checkpointed): the KL reference (TR-DPO's syncs move it) and the entropy
controller (Skywork-OR1's adaptive coefficient).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from localrl.config import TrainConfig
from localrl.objectives import Objective, StepContext, objectives, step_record
from localrl.policy.grpo import update
from localrl.policy.reference import Reference

if TYPE_CHECKING:
    from localrl.samplers import Batch


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient through a run: ``entropy_coef``, or with ``use_adaptive_entropy``
    Skywork-OR1's controller as TRL has it: the coefficient applies only while the last step's entropy was
    at most ``entropy_target`` (none before the first measurement), and after each step it rises by
    ``entropy_coef_delta`` if the entropy was at most the target and falls by it otherwise, within
    [``entropy_coef_min``, ``entropy_coef_max``]. Checkpointed with the run (``state``)."""

    coef: float
    last_entropy: float = math.inf

    def applied(self, cfg: TrainConfig) -> float:
        if not cfg.use_adaptive_entropy:
            return cfg.entropy_coef
        return self.coef if self.last_entropy <= cfg.entropy_target else 0.0

    def observe(self, entropy: float | None, cfg: TrainConfig) -> None:
        if not cfg.use_adaptive_entropy or entropy is None:
            return
        if entropy <= cfg.entropy_target:
            self.coef = min(self.coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
        else:
            self.coef = max(self.coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)
        self.last_entropy = entropy

    def state(self) -> dict:
        return {"entropy_coef": self.coef, "last_entropy": self.last_entropy}


@objectives.register("grpo")
class GRPO(Objective):
    about = "GRPO and TRL's family of policy losses (loss_type), over any sampler (the default)"
    group_relative = True

    def setup(self, ctx: StepContext, state: dict) -> None:
        self.reference = Reference(state.get("reference"))
        self.entropy = EntropyControl(state.get("entropy_coef", self.cfg.entropy_coef),
                                      state.get("last_entropy", math.inf))

    def step(self, ctx: StepContext, step: int, tokens: int) -> dict:
        t0 = time.time()
        batch = ctx.sampler.sample(ctx, step, tokens, self.system)
        rewards = batch.rewards if batch.train_rewards is None else batch.train_rewards
        terms = {"reward_rows": batch.reward_rows, "advantages": batch.advantages, **self.update_terms(step, batch)}
        stats = update(ctx.model, ctx.optimizer, batch.rollout, rewards, self.cfg, step, ctx.budget, batch.sampler_logp,
                       self.reference, self.entropy.applied(self.cfg), max_len=batch.max_len, **terms)
        record = step_record(step, batch.rewards, batch.scores, batch.names, stats,  # of every completion sampled
                             batch.lengths, batch.truncated, t0, batch.gen_s, ctx.optimizer.param_groups[0]["lr"],
                             ctx.device)
        return {**record, **self.batch_record(batch), **batch.extra}

    def update_terms(self, step: int, batch: Batch) -> dict:
        """What a variant passes to ``update`` at 0-based ``step`` for ``batch``, over GRPO's (keyword arguments:
        the sampler's ``advantages`` replaced, a ``contrast`` added); GRPO: nothing."""
        return {}

    def batch_record(self, batch: Batch) -> dict:
        """What a variant adds to the step's record from ``batch``; GRPO: nothing."""
        return {}

    def after_step(self, ctx: StepContext, step: int, record: dict) -> None:
        cfg = self.cfg
        if cfg.use_adaptive_entropy:
            record["entropy_coef"] = self.entropy.applied(cfg)
            self.entropy.observe(record.get("entropy"), cfg)
        if self.reference.on_schedule(ctx.model, ctx.optimizer, cfg, step):
            record["ref_synced"] = True

    def state(self) -> dict:
        return {"reference": self.reference.state, **self.entropy.state()}


def step_on_task(model, tok, optimizer, task, step: int, cfg, rewards, weights, stops: list[int],
                 budget=None) -> dict:
    """One GRPO step on ``task``'s prompts outside a run (the benchmarks, tests): torch samples; returns the
    step's metrics record, as a run's would be."""
    from localrl.distributed import world
    from localrl.samplers.completions import Completions

    sampler = Completions(cfg, (rewards, weights))
    sampler.task = task
    ctx = StepContext(cfg, model, tok, optimizer, sampler, budget, stops, world(), None,
                      next(model.parameters()).device)
    objective = GRPO(cfg)
    objective.setup(ctx, {})
    return objective.step(ctx, step, cfg.max_new_tokens)
