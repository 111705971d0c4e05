"""Objectives: what a training step optimises. The loop (``localrl.training.loop.train``) owns the run (its
directory, resume, evaluations, checkpoints, signals, ranks, monitors, metrics) and asks the objective
named by ``cfg.objective`` for everything else:

    objective = objectives.get(cfg.objective)(cfg)
    objective.check(world)                      # settings, and what it refuses under torchrun
    objective.preflight(info, sampler, plan)    # before weights load: another model it needs, if any
    objective.setup(ctx, state)                 # after the model (and a checkpoint's extra state) loaded
    record = objective.step(ctx, step, tokens)  # one step: a metrics record {"kind": "train", "step": ...}
    objective.after_step(ctx, step, record)     # the record pooled over ranks: controllers, files
    objective.state()                           # extra state every checkpoint keeps
    objective.summary(record)                   # one line for the progress bar and the terminal UI

An objective samples through ``ctx.sampler`` (``localrl.samplers``: prompt completions, Markovian traces,
multi-turn episodes), so one objective runs over every sampler: GRPO on prompts, on Markovian traces and
on an environment's episodes is one objective. Everything a step needs comes in ``StepContext`` and the
arguments; the config is never rewritten to carry it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from localrl.data.monitors import length_correlation
from localrl.memory import peak_memory_mb
from localrl.registry import Registry

if TYPE_CHECKING:
    import torch

    from localrl.config import TrainConfig
    from localrl.distributed import World
    from localrl.memory import DecodingPhase, MemoryBudget
    from localrl.runs import Run
    from localrl.samplers import ModelInfo, Plan, Sampler

objectives = Registry("objective", "objective", "localrl.objectives")


@dataclass
class StepContext:
    """What a run hands its objective: built once by the loop, after the model loaded."""

    cfg: TrainConfig
    model: Any  # the policy (a peft model)
    tok: Any
    optimizer: torch.optim.Optimizer
    sampler: Sampler
    budget: MemoryBudget  # the run's memory plan (micro-batches, rollout chunks)
    stops: list[int]  # token ids that end a completion
    world: World
    run: Run
    device: torch.device
    extra_model_path: str = ""  # the frozen model the objective's preflight asked for ("" : none)
    log: Any = print


class Objective(ABC):
    """The base of an objective: every hook but ``step`` (abstract) has a default that does nothing."""

    rows_per_prompt: int | None = None  # completions a step trains per prompt (None: group_size), for the planner
    sample_rewards = True  # whether its records carry the sampler's rewards (and their shares)
    preset: dict[str, Any] = {}  # what selecting it changes from the defaults, unless the file or the flags set it
    owns: tuple[str, ...] = ()  # config fields that mean something only when it is selected (localrl.registry)
    # what it can train on, asked by the samplers that need it (``Sampler.needs``), never by name:
    samples = True  # it trains on what its sampler samples (sft learns from an environment's expert episodes)
    group_relative = False  # its advantages compare each group's rows (GRPO's family), however a sampler formed them
    takes_pairs = False  # it trains on fixed (chosen, rejected) pairs handed over as they are
    imitates = False  # it learns to reproduce completions handed over as they are (demonstrations)

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    @staticmethod
    def check_settings(cfg: TrainConfig) -> None:
        """Check its own config fields and the combinations it cannot run with, selected or not (``check_config``
        calls it; ``localrl.config.check_fields`` words the error)."""

    def check(self, world: World) -> None:
        """Refuse what it cannot run with in this launch, in one line naming the field (torchrun included)."""

    def prompt_tokens(self, info: ModelInfo) -> int:
        """Tokens it adds to every prompt (a system message of its own), which the sampler then holds free in the
        context and the memory plan counts; 0: none."""
        return 0

    def preflight(self, info: ModelInfo, sampler: Sampler, plan: Plan) -> tuple[str, DecodingPhase | None]:
        """Before weights load, after the sampler's preflight (``plan``): another model it needs (its resolved
        path, "" for none) and a decoding phase of its own in each step (None: none), which the run's memory
        plan then holds."""
        return "", None

    def setup(self, ctx: StepContext, state: dict) -> None:
        """After the model loaded; ``state``: what ``state()`` returned at the checkpoint resumed from ({} new)."""

    @abstractmethod
    def step(self, ctx: StepContext, step: int, tokens: int) -> dict:
        """One step (0-based ``step``; ``tokens``: this step's completion budget); its metrics record."""

    def after_step(self, ctx: StepContext, step: int, record: dict) -> None:
        """After the ranks' records are pooled, before the record is written: may add to it."""

    def state(self) -> dict:
        """Extra state a checkpoint keeps, handed back to ``setup`` on resume."""
        return {}

    def system(self, base: str | None) -> str | None:
        """The system message sampling and evaluation use, given the task's."""
        return base

    def summary(self, record: dict) -> str:
        """A step in one line (the progress bar's, the terminal UI's)."""
        kl = "" if record.get("kl") is None else f"  kl {record['kl']:.4f}"
        if "reward_mean" not in record:
            return f"loss {record.get('loss', 0.0):.4f}"
        return f"reward {record['reward_mean']:.3f}  acc {record.get('accuracy', 0.0):.1%}{kl}"


def objective_for(cfg: TrainConfig) -> Objective:
    """The configured objective, made for ``cfg``."""
    return objectives.get(cfg.objective)(cfg)


def step_record(step: int, rewards: torch.Tensor, scores: list[list[float]], names: list[str], stats: dict,
                lengths: list[int], truncated: float, started: float, gen_s: float, lr: float, device) -> dict:
    """The metrics record of a single-turn step (0-based ``step``, begun at time ``started``): the rewards'
    mean and std over the completions sampled (``lengths`` tokens each), accuracy (the share the first,
    correctness, reward scores 1), each reward's mean, the update's loss and whichever of KL, clip fraction and
    the optional statistics it has, the correlation of reward with completion length (a reward-hacking sign;
    under torchrun, this rank's completions), and the step's speed and memory."""
    elapsed = time.time() - started
    return {
        "kind": "train",
        "step": step + 1,
        "completions": len(lengths),
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        "accuracy": sum(s == 1.0 for s in scores[0]) / len(scores[0]),
        "rewards": {name: sum(s) / len(s) for name, s in zip(names, scores)},
        "loss": stats["loss"],
        "reward_length_corr": length_correlation(rewards.tolist(), lengths),
        "completion_len": sum(lengths) / len(lengths),
        "truncated": truncated,
        "frac_reward_zero_std": stats["frac_reward_zero_std"],
        "tokens_per_s": sum(lengths) / max(elapsed, 1e-9),
        "gen_s": round(gen_s, 3),
        "step_s": round(elapsed, 3),
        "lr": lr,
        "micro_batch": stats["micro_batch"],
        "peak_mem_mb": peak_memory_mb(device),
        **{k: stats[k] for k in ("kl", "clip_frac", "entropy", "is_weight", "contrastive", "allreduce_s")
           if k in stats},
    }
