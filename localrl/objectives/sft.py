"""Supervised warm start as an objective (the demonstrations and the loss are ``localrl.policy.sft``): each step plays
the environment's expert on ``prompts_per_step`` training tasks (a pure function of (seed, step)), keeps the
episodes its verifier scores 1, and takes one AdamW step on their mean negative log-likelihood. It samples
nothing; the run's held-out evaluations play the model's own greedy episodes, as any run in an environment
does. ``localrl sft`` is ``localrl train --objective sft``.
"""

from __future__ import annotations

import time

from localrl.config import check_fields
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
    # `--objective sft` (`localrl sft`) trains on the shell's expert episodes unless env is set. Its learning rate
    # stays the default (2e-3, sized for the built-in models: tiny-shell 25% -> 77% held-out in 30 steps; 5e-4
    # reached 51%); a real model wants less (SmolLM2-135M was warm-started at 5e-4).
    preset = {"env": "shell"}

    @staticmethod
    def check_selected(cfg) -> None:
        check_fields(cfg, [("objective", bool(cfg.env),
                            "sft learns from an environment's expert episodes: it needs env (e.g. 'shell')")])

    def check(self, w) -> None:
        w.one_process("objective", "sft")

    def preflight(self, info, sampler, plan):
        """The environment must have an expert, and training tasks it solves."""
        setup = getattr(sampler, "setup", None)
        if setup is None or setup.expert is None:
            raise UserError(f"config field objective: sft learns from an environment's expert episodes; "
                            f"env {self.cfg.env or '(none)'} has no expert", field="objective")
        if setup.expert_tasks is not None:
            setup.train = setup.expert_tasks()
        return "", None

    def step(self, ctx: StepContext, step: int, tokens: int) -> dict:
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

    def summary(self, record: dict) -> str:
        return f"loss {record['loss']:.4f}  {record['demos']} demos"
