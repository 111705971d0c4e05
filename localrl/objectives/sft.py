"""Supervised fine-tuning as an objective (the demonstrations and the loss are ``localrl.policy.sft``): one AdamW
step a step on the mean negative log-likelihood of ``prompts_per_step`` demonstrations (a pure function of
(seed, step)), from either

- an environment's expert (``env``, the shell by default): its episodes on training tasks, kept where the verifier
  scores them 1 (a warm start before RL); the held-out evaluations play the model's own greedy episodes;
- prompt-completion rows (``--data FILE``: TRL's SFT data, handed over by the demonstrations sampler, which the
  data's columns select); the held-out evaluations score held-out rows teacher-forced.

It samples nothing. ``localrl sft`` is ``localrl train --objective sft``.
"""

from __future__ import annotations

import time

from localrl.config import BUILTIN_TASKS, check_fields
from localrl.envs import task_seeds
from localrl.errors import UserError
from localrl.generation.agent_rollout import TurnFormat
from localrl.memory import peak_memory_mb
from localrl.objectives import Objective, StepContext, objectives
from localrl.policy.grpo import batch_plan
from localrl.policy.sft import demo_rollout, end_of_turn, expert_demos, nll_step


@objectives.register("sft")
class SFT(Objective):
    about = "supervised warm start on the environment's expert episodes, as `localrl sft` runs it; needs env"
    rows_per_prompt = 1  # one (expert) trajectory per task
    sample_rewards = False
    samples = False
    imitates = True
    handed = False  # the sampler hands the demonstrations over (preflight decides)
    # `--objective sft` (`localrl sft`) trains on the shell's expert episodes unless env or data is set. Its learning
    # rate stays the default (2e-3, sized for the built-in models: tiny-shell 25% -> 77% held-out in 30 steps; 5e-4
    # reached 51%); a real model wants less (SmolLM2-135M was warm-started at 5e-4).
    preset = {"env": "shell"}

    @staticmethod
    def check_selected(cfg) -> None:
        check_fields(cfg, [("objective", bool(cfg.env) or cfg.data not in BUILTIN_TASKS,
                            "sft learns from an environment's expert episodes (env, e.g. 'shell') or from "
                            "prompt-completion rows (data)")])

    def check(self, w) -> None:
        w.one_process("objective", "sft")

    def preflight(self, info, sampler, plan):
        """An environment must have an expert, and training tasks it solves (a sampler without an environment hands
        its demonstrations over itself)."""
        setup = getattr(sampler, "setup", None)
        self.handed = setup is None and getattr(sampler, "needs", {}).get("imitates") is not None
        if self.handed:
            return "", None
        if setup is None or setup.expert is None:
            raise UserError(f"config field objective: sft learns from an environment's expert episodes; "
                            f"env {self.cfg.env or '(none)'} has no expert", field="objective")
        if setup.expert_tasks is not None:
            setup.train = setup.expert_tasks()
        return "", None

    def step(self, ctx: StepContext, step: int, tokens: int) -> dict:
        if self.handed:
            return self._handed_step(ctx, step, tokens)
        cfg, setup = self.cfg, ctx.sampler.setup
        t0 = time.time()
        demos = expert_demos(setup, task_seeds(cfg, step), cfg.env_workers)
        kept = [d for d in demos if d.reward == 1.0]
        if not kept:
            raise UserError(f"step {step + 1}: no expert solution of this step's {len(demos)} tasks passes its "
                            f"check (for example {demos[0].instruction!r}); warm starts need tasks whose solution "
                            f"solves them")
        t_env = time.time() - t0
        fmt = TurnFormat(ctx.tok, setup.system)
        rollout = demo_rollout(fmt, kept, end_of_turn(fmt, ctx.stops))
        micro_batch, logits_chunk = batch_plan(ctx.model, rollout, cfg, step, ctx.budget)
        loss = nll_step(ctx.model, ctx.optimizer, rollout, cfg, micro_batch, logits_chunk)
        elapsed = time.time() - t0
        n = int(rollout.trained_mask.sum())
        return {
            "kind": "train",
            "objective": "sft",
            "step": step + 1,
            "loss": loss,
            "demos": len(kept),
            "demos_failed": len(demos) - len(kept),  # expert episodes the verifier did not score 1 (left out)
            "turns": sum(len(d.turns) for d in kept) / len(kept),
            "completion_len": n / len(kept),
            "tokens_per_s": n / max(elapsed, 1e-9),
            "env_s": round(t_env, 3),
            "step_s": round(elapsed, 3),
            "lr": ctx.optimizer.param_groups[0]["lr"],
            "micro_batch": micro_batch or len(kept),
            "peak_mem_mb": peak_memory_mb(ctx.device),
            **setup.details,
        }

    def _handed_step(self, ctx: StepContext, step: int, tokens: int) -> dict:
        """A step on the demonstrations the sampler hands over (prompt-completion rows)."""
        t0 = time.time()
        batch = ctx.sampler.sample(ctx, step, tokens, self.system)
        micro_batch, logits_chunk = batch_plan(ctx.model, batch.rollout, self.cfg, step, ctx.budget)
        loss = nll_step(ctx.model, ctx.optimizer, batch.rollout, self.cfg, micro_batch, logits_chunk)
        elapsed = time.time() - t0
        n = int(batch.rollout.trained_mask.sum())
        rows = len(batch.lengths)
        return {"kind": "train", "objective": "sft", "step": step + 1, "loss": loss, "demos": rows,
                "completion_len": n / max(rows, 1), "tokens_per_s": n / max(elapsed, 1e-9),
                "step_s": round(elapsed, 3), "lr": ctx.optimizer.param_groups[0]["lr"],
                "micro_batch": micro_batch or rows, "peak_mem_mb": peak_memory_mb(ctx.device), **batch.extra}

    def summary(self, record: dict) -> str:
        return f"loss {record['loss']:.4f}  {record['demos']} demos"
