"""Multi-turn episodes in an environment (``--env NAME``, ``localrl.envs``): ``group_size`` episodes of each
of a step's tasks, each scored by the environment's verifier. Selected by ``env``.

A step draws ``prompts_per_step`` tasks from (seed, step) and plays ``group_size`` episodes of each
(``agent_rollout.run_episodes``): the group shares the prompt (the shared-prompt forward applies), each
trajectory is one completion, and only the model's own tokens carry loss. The held-out evaluation plays
one greedy episode of every held-out task: the success rate overall and per family, with 95% intervals.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial

import torch

from localrl.config import FIELDS, check_fields
from localrl.envs import EnvSetup, environment_for, is_game, task_list, task_seeds
from localrl.errors import UserError, failure_line, user_callable
from localrl.generation.agent_rollout import TurnFormat, run_episodes, trajectory_budget
from localrl.metrics import item_progress
from localrl.samplers import Batch, Measure, ModelInfo, Plan, Sampler, samplers


# the fields that say where single-turn prompts come from: an environment's tasks come from env_tasks instead
DATA_FIELDS = ("data", "eval_data", "data_config", "data_split", "eval_split", "prompt_column", "answer_column",
               "answer_format")


@samplers.register("episodes")
class Episodes(Sampler):
    about = "multi-turn episodes in the environment env names; picked by env"
    measure = Measure("success", "tasks", "greedy episodes")

    def __init__(self, cfg, rewards=None):
        super().__init__(cfg)
        self.setup: EnvSetup | None = None
        self.context: int | None = None  # the model's (prepare sets it)
        self.process: Callable[[dict], float] | None = None  # the user's process reward (prepare resolves it)

    @classmethod
    def selects(cls, cfg) -> bool:
        return bool(cfg.env) and not is_game(cfg.env)  # (a two-policy game is self-play's)

    @staticmethod
    def check_settings(cfg) -> None:
        episodes = bool(cfg.env)  # (the data fields and the rollout backend: a game's too)
        check_fields(cfg, [
            *[(name, not episodes or getattr(cfg, name) == FIELDS[name].default,
               "is for single-turn prompts; an environment's tasks come from env_tasks") for name in DATA_FIELDS],
            ("calibration_weight", not (episodes and cfg.calibration_weight), "is for single-turn tasks (not env)"),
            ("rollout", not (episodes and cfg.rollout == "llama.cpp"),
             "multi-turn episodes are sampled by torch (rollout = auto or torch)"),
            ("max_turns", cfg.max_turns >= 1, "must be at least 1"),
            ("process_reward", not cfg.process_reward or episodes, "scores an environment's turns: it needs env"),
            ("process_reward", not cfg.process_reward or ":" in cfg.process_reward, "must be package.module:function"),
            ("env_workers", cfg.env_workers >= 1, "must be at least 1"),
        ])

    def prepare(self, info: ModelInfo | None, reserve: int = 0) -> Plan:
        """The tasks and the environment (its own checks), every held-out prompt against the context, and the
        longest trajectory (every turn and tool output at its limit, within the context) for the planner."""
        cfg = self.cfg
        self.setup = environment_for(cfg)
        if info is None:
            return Plan(0, cfg.max_new_tokens)
        self.context = info.context or 2048
        if cfg.process_reward:
            self.process = self._process_reward()
        fmt = TurnFormat(info.tok, self.setup.system)
        longest = max((len(fmt.prompt_ids(t.instruction)) for t in self.setup.held_out), default=0)
        if longest + cfg.max_new_tokens > self.context:
            raise UserError(f"config field max_new_tokens: a held-out task's prompt is {longest} tokens; with "
                            f"max_new_tokens {cfg.max_new_tokens} a turn does not fit the model's context of "
                            f"{self.context} tokens", field="max_new_tokens")
        trajectory = min(self.context - longest, trajectory_budget(fmt, cfg.max_turns, cfg.max_new_tokens))
        why = "; ".join(filter(None, ["rollouts: torch, multi-turn episodes", self.setup.describe]))
        return Plan(longest, trajectory, "torch", why, extra_bytes=self.setup.memory)

    def _process_reward(self) -> Callable[[dict], float]:
        """The user's process reward, called once on a fresh episode's state, so that one that cannot be imported,
        fails or returns no number stops the run before anything is written."""
        fn = user_callable(self.cfg.process_reward, "process reward", "process_reward")
        env = self.setup.make_env()
        try:
            if not callable(getattr(env, "state", None)):
                raise UserError(f"config field process_reward: the {self.cfg.env} environment gives no state to "
                                f"score (it has no state())", field="process_reward")
            env.reset(0)
            process_value(fn, env, self.cfg.process_reward)
        finally:
            env.close()
        return fn

    def make_env(self):
        """An environment for a training episode: the user's process reward, where set, gives its turn rewards."""
        env = self.setup.make_env()
        if self.process is not None:
            env.turn_reward = partial(process_value, self.process, env, self.cfg.process_reward)
        return env

    @property
    def held_out(self) -> list:
        return list(self.setup.held_out) if self.setup is not None else []

    def close(self) -> None:
        if self.setup is not None:
            self.setup.release()

    def describe_eval(self) -> str:
        return f"in the {self.cfg.env} environment"

    @staticmethod
    def eval_line(r: dict) -> str:
        lo, hi = r["interval"]
        return (f"success {r['accuracy']:.1%} [95% CI {lo:.1%}, {hi:.1%}], mean reward {r['reward_mean']:.3f}, "
                f"{r['turns']:.1f} turns, {r.get('tool_calls', 0):.2f} tool calls and {r['invalid_calls']:.2f} "
                f"invalid calls per episode ({r['n']} held-out tasks, greedy)")

    def require_held_out(self) -> None:
        if not self.held_out:
            raise UserError(f"env_tasks {self.cfg.env_tasks}: no held-out tasks to evaluate on", field="env_tasks")

    def sample(self, ctx, step: int, tokens: int, system=lambda s: s) -> Batch:
        cfg, w, model, tok = self.cfg, ctx.world, ctx.model, ctx.tok
        t0 = time.time()
        model.eval()
        # under torchrun: this rank's tasks of the global batch, sampled from a generator of its own
        seed = cfg.seed * 1_000_003 + step
        generator = torch.Generator(device=ctx.device).manual_seed(
            seed if w.rank == 0 else (seed * 1_000_033 + w.rank) % 2**63)
        seeds = task_seeds(cfg, step, w.size)[w.shard(cfg.prompts_per_step)]
        budget = ctx.budget
        at_once = None if budget is None else budget.rollout_prompts(len(seeds), cfg.group_size,
                                                                      budget.longest_prompt, budget.cfg.max_new_tokens)
        episodes = run_episodes(model, tok, self.make_env, seeds, cfg.group_size, tokens, ctx.stops,
                                cfg.temperature, generator, self.context or 2048, cfg.env_workers, system(self.setup.system),
                                tasks_at_once=at_once)
        rollout = episodes.rollout
        rewards = torch.tensor(episodes.rewards, dtype=torch.float64)
        return Batch(rollout, rewards, [list(episodes.rewards)], ["env"],
                     rollout.trained_mask.sum(1).tolist(), rollout.truncated.float().mean().item(), time.time() - t0,
                     cfg.max_turns * tokens,  # dr_grpo's constant: the longest trajectory's model tokens
                     extra={**self.setup.details, **{k: v for k, v in episodes.stats.items() if k != "success"}},
                     turn_spans=[e.turn_spans for e in episodes.episodes],
                     turn_rewards=[e.turn_rewards for e in episodes.episodes])

    @torch.no_grad()
    def evaluate(self, model, tok, progress: Callable[[int, int], None] | None = None, batch_size: int = 32,
                 system=lambda s: s, samples: int = 0, stops: list[int] | None = None) -> dict:
        """Greedy episodes of every held-out task: success rate (reward 1) overall and per family, each with
        a 95% Wilson interval, the mean reward, turns, tool calls and invalid calls per episode."""
        from localrl.generation.rollout import stop_token_ids

        cfg, setup = self.cfg, self.setup
        stops = stops if stops is not None else stop_token_ids(tok, model)
        context = self.context or getattr(model.config, "max_position_embeddings", None) or 2048
        tasks = list(setup.held_out)
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
            out = run_episodes(model, tok, lambda: setup.eval_env(task_list(chunk)), list(range(len(chunk))), 1,
                               cfg.max_new_tokens, stops, 0.0, None, context, cfg.env_workers,
                               system(setup.system), ended)
            for task, episode in zip(chunk, out.episodes):
                by_family[getattr(task, "family", "all")].append(episode.reward)
                if len(shown) < samples:
                    shown.append({"task": task.instruction, "family": getattr(task, "family", "all"),
                                  "level": getattr(task, "level", None), "turns": episode.texts,
                                  "observations": episode.observations, "reward": episode.reward})
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
            "families": family_success(by_family),
        }
        return {**result, "samples": shown} if samples else result


def process_value(fn: Callable[[dict], float], env, name: str) -> float:
    """``fn`` of ``env``'s state, as a float; a failure or a non-number is one line naming the function."""
    try:
        value = float(fn(env.state()))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's function: say which failed and how, in one line
        raise UserError(f"process reward {name} failed: {failure_line(e)}", field="process_reward") from None
    if not math.isfinite(value):
        raise UserError(f"process reward {name} returned {value}", field="process_reward")
    return value


def family_success(by_family: dict[str, list[float]]) -> dict[str, dict]:
    """Per family, of its rewards: the success rate (reward 1), its 95% Wilson interval and the count."""
    return {f: {"success": sum(r == 1.0 for r in rs) / len(rs), "interval": wilson(sum(r == 1.0 for r in rs), len(rs)),
                "n": len(rs)} for f, rs in sorted(by_family.items())}


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a success rate."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4))
