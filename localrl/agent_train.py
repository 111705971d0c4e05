"""Agentic GRPO: one training step on multi-turn episodes, and the held-out evaluation of episodes.

A step draws ``prompts_per_step`` tasks from (seed, step), plays ``group_size`` episodes of
each in the environment (``agent_rollout.run_episodes``), takes each episode's verifier score
as its reward, and updates the policy with the same ``grpo_step`` as single-turn training:
the group shares the prompt (the shared-prompt forward applies), each trajectory is one
completion, and only the model's own tokens carry loss.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from localrl.agent import system_message
from localrl.agent_rollout import run_episodes
from localrl.agent_session import agent_system
from localrl.config import TrainConfig, split_list
from localrl.distributed import world
from localrl.envs.shell import ShellEnv, TaskSource, generated_tasks, task_list
from localrl.envs.shell_tasks import FAMILIES, LEVELS, ShellTask, held_out_tasks, load_tasks
from localrl.errors import UserError
from localrl.grpo import update
from localrl.memory import peak_memory_mb
from localrl.metrics import item_progress
from localrl.sandbox import level_works, strongest_level


@dataclass
class EnvSetup:
    """Where a run's episodes come from: the training tasks, the held-out tasks, and the sandbox."""

    train: TaskSource
    held_out: list[ShellTask]
    isolation: str
    cfg: TrainConfig
    system: str | None  # every episode's system message (None: none)

    def make_env(self, tasks: TaskSource | None = None) -> ShellEnv:
        return ShellEnv(tasks or self.train, self.cfg.max_turns, self.cfg.env_timeout, self.isolation)


def env_setup(cfg: TrainConfig) -> EnvSetup:
    """Check and load what the environment needs (before any model loads)."""
    if cfg.isolation == "auto":
        isolation = strongest_level()
    elif not level_works(cfg.isolation):
        raise UserError(f"config field isolation: {cfg.isolation} does not work on this machine", field="isolation")
    else:
        isolation = cfg.isolation
    system = agent_system_prompt(cfg.system_prompt, cfg.model)
    if not cfg.env_tasks:
        families = tuple(split_list(cfg.env_families)) or FAMILIES
        levels = tuple(int(lv) for lv in split_list(cfg.env_levels)) or LEVELS
        return EnvSetup(generated_tasks(False, families, levels), held_out_tasks(cfg.eval_size), isolation, cfg,
                        system)
    tasks = load_tasks(cfg.env_tasks)
    held = [t for t in tasks if t.is_held_out()]
    train = [t for t in tasks if not t.is_held_out()] or tasks
    if cfg.objective == "sft":  # a warm start learns from the solutions
        train = [t for t in train if t.solution]
        if not train:
            raise UserError(f"config field env_tasks: {cfg.env_tasks}: no training task has a \"solution\" (the "
                            f"expert's commands) for sft to learn from", field="env_tasks")
    return EnvSetup(lambda seed: train[random.Random(seed).randrange(len(train))], held[:cfg.eval_size],
                    isolation, cfg, system)


def agent_system_prompt(setting: str, model: str) -> str | None:
    """The system message of training episodes: as an agent session's (``agent_session.agent_system``),
    except that an episode names no directory and has no one to approve."""
    system = agent_system(setting, model)
    return system_message(None, approvals=False)["content"] if system == "" else system


def task_seeds(cfg: TrainConfig, step: int, ranks: int = 1) -> list[int]:
    """One environment seed per prompt of ``step``'s global batch (``prompts_per_step`` x ``ranks``): a pure
    function of (seed, step), whose first ``prompts_per_step`` are those of a single process."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    return [rng.randrange(2**62) for _ in range(cfg.prompts_per_step * ranks)]


def agent_step(model, tok, optimizer, setup: EnvSetup, step: int, cfg: TrainConfig, stops: list[int],
               max_context: int, budget=None, reference=None, entropy_coef: float | None = None) -> dict:
    """One whole agentic GRPO step; returns its metrics record."""
    t0 = time.time()
    device = next(model.parameters()).device
    model.eval()
    w = world()  # under torchrun: this rank's tasks of the global batch, sampled from a generator of its own
    seed = cfg.seed * 1_000_003 + step
    generator = torch.Generator(device=device).manual_seed(seed if w.rank == 0 else (seed * 1_000_033 + w.rank) % 2**63)
    seeds = task_seeds(cfg, step, w.size)[w.shard(cfg.prompts_per_step)]
    at_once = None if budget is None else budget.rollout_prompts(len(seeds), cfg.group_size, budget.longest_prompt,
                                                                  budget.cfg.max_new_tokens)
    episodes = run_episodes(model, tok, setup.make_env, seeds, cfg.group_size, cfg.max_new_tokens,
                            stops, cfg.temperature, generator, max_context, cfg.env_workers, setup.system,
                            tasks_at_once=at_once)
    t_gen = time.time() - t0
    rollout = episodes.rollout
    rewards = torch.tensor(episodes.rewards, dtype=torch.float64)
    # dr_grpo's constant: the longest trajectory's model tokens could be max_turns full turns
    stats = update(model, optimizer, rollout, rewards, replace(cfg, max_new_tokens=cfg.max_turns * cfg.max_new_tokens),
                   step, budget, reference=reference, entropy_coef=entropy_coef)
    elapsed = time.time() - t0
    model_tokens = int(episodes.rollout.trained_mask.sum())
    return {
        "kind": "train",
        "step": step + 1,
        "completions": len(episodes.rewards),
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        "accuracy": episodes.stats["success"],
        "rewards": {"env": rewards.mean().item()},
        "loss": stats["loss"],
        "kl": stats["kl"],
        "clip_frac": stats["clip_frac"],
        "completion_len": model_tokens / len(episodes.rewards),
        "truncated": rollout.truncated.float().mean().item(),
        "frac_reward_zero_std": stats["frac_reward_zero_std"],
        "tokens_per_s": model_tokens / max(elapsed, 1e-9),
        "gen_s": round(t_gen, 3),
        "step_s": round(elapsed, 3),
        "lr": optimizer.param_groups[0]["lr"],
        "micro_batch": stats["micro_batch"],
        "peak_mem_mb": peak_memory_mb(device),
        "isolation": setup.isolation,
        **({"entropy": stats["entropy"]} if "entropy" in stats else {}),
        **({"allreduce_s": stats["allreduce_s"]} if "allreduce_s" in stats else {}),
        **{k: v for k, v in episodes.stats.items() if k != "success"},
    }


@torch.no_grad()
def evaluate_episodes(model, tok, setup: EnvSetup, cfg: TrainConfig, stops: list[int], max_context: int,
                      progress: Callable[[int, int], None] | None = None, batch_size: int = 32,
                      samples: int = 0) -> dict:
    """Greedy episodes of every held-out task: success rate (reward 1) overall and per family, each with
    a 95% Wilson interval, the mean reward, turns, tool calls and invalid calls per episode."""
    tasks = setup.held_out
    was_training = model.training
    model.eval()
    by_family: dict[str, list[float]] = defaultdict(list)
    rewards, turns, calls, invalid, shown = [], 0.0, 0.0, 0.0, []
    items = item_progress(progress)  # within a batch: at most once a second; each batch's start always
    for i in range(0, len(tasks), batch_size):
        if progress is not None:
            progress(i, len(tasks))
        chunk = tasks[i:i + batch_size]
        ended = None if items is None else (lambda finished, i=i: items(i + finished, len(tasks)))
        out = run_episodes(model, tok, lambda: setup.make_env(task_list(chunk)), list(range(len(chunk))), 1,
                           cfg.max_new_tokens, stops, 0.0, None, max_context, cfg.env_workers, setup.system, ended)
        for task, episode in zip(chunk, out.episodes):
            by_family[task.family].append(episode.reward)
            if len(shown) < samples:
                shown.append({"task": task.instruction, "family": task.family, "level": task.level,
                              "turns": episode.texts, "observations": episode.observations,
                              "reward": episode.reward})
        rewards += out.rewards
        turns += out.stats["turns"] * len(chunk)
        calls += out.stats["tool_calls"] * len(chunk)
        invalid += out.stats["invalid_calls"] * len(chunk)
    if progress is not None:
        progress(len(tasks), len(tasks))
    model.train(was_training)
    n = len(rewards)
    successes = sum(r == 1.0 for r in rewards)
    result = {
        "accuracy": successes / max(n, 1),
        "interval": wilson(successes, n),
        "reward_mean": sum(rewards) / max(n, 1),
        "n": n,
        "turns": turns / max(n, 1),
        "tool_calls": calls / max(n, 1),
        "invalid_calls": invalid / max(n, 1),
        "families": {f: {"success": sum(r == 1.0 for r in rs) / len(rs), "interval": wilson(sum(r == 1.0 for r in rs),
                                                                                            len(rs)), "n": len(rs)}
                     for f, rs in sorted(by_family.items())},
    }
    return {**result, "samples": shown} if samples else result


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a success rate."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4))
