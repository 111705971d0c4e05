"""Environments for multi-turn rollouts.

An environment is one episode at a time, in the shape TRL's ``environment_factory``, verl's
agent loop and SkyRL's ``BaseTextEnv`` users know:

    observation = env.reset(seed)           # the task, as the first user message
    observation, done = env.step(action)    # the model's whole turn in, the tool's output back
    score = env.reward()                    # [0, 1], from a verifier of the final state
    env.close()                             # remove what the episode made

and, optionally, ``env.turn_reward()`` after each step: a process reward for the turn just taken (None: none),
which turn-level objectives (``turn_grpo``) credit to that turn's tokens.

``reset(seed)`` makes the episode reproducible: the same seed gives the same task and the same
starting state. The rollout loop (``localrl/generation/agent_rollout.py``) owns the chat template, the
token masks and the model; an environment sees and returns text only.

An environment is a plug-in, registered by name (``--env NAME``) or named as
``package.module:function``: a function of the run's config that returns an ``EnvSetup`` (its
task source, held-out tasks, a factory of episodes, the system message, what each step record
carries). The sandboxed shell (``localrl.envs.shell``) is one such registration; its tasks
(``shell_tasks``) and the sandbox under it (``sandbox``, ``confine``, ``cgroups``) live beside it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from localrl.registry import Registry

environments = Registry("environment", "env", "localrl.envs")
TaskSource = Callable[[int], Any]  # an episode's seed -> its task


class Environment(Protocol):
    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> tuple[str, bool]: ...

    def reward(self) -> float: ...

    def close(self) -> None: ...


@dataclass
class EnvSetup:
    """Where a run's episodes come from: what ``environments.get(cfg.env)(cfg)`` returns, before any model
    loads (it checks what it needs: a sandbox, a task file, ...)."""

    train: TaskSource  # the task of a training episode, by its seed
    held_out: Sequence[Any]  # held-out tasks: each has ``instruction`` (and ``family``, for a per-family report)
    factory: Callable[[TaskSource], Environment]  # an environment whose ``reset(seed)`` plays ``tasks(seed)``
    system: str | None = None  # every episode's system message (None: none)
    details: dict = field(default_factory=dict)  # fields every step record carries (the shell: its isolation)
    describe: str = ""  # a line for the run's start
    expert: Callable[[Environment, int], tuple[float, list[tuple[str, str]]]] | None = None  # (score, turns)
    expert_tasks: Callable[[], TaskSource] | None = None  # the training tasks the expert can solve
    evaluate: Callable[[TaskSource], Environment] | None = None  # the held-out tasks' environment (None: factory's)
    memory: int = 0  # bytes the environment holds all run, in the run's memory plan (a world model's weights, caches)

    def make_env(self, tasks: TaskSource | None = None) -> Environment:
        return self.factory(tasks or self.train)

    def eval_env(self, tasks: TaskSource) -> Environment:
        """An environment for held-out episodes (a simulated environment's are played in the real one)."""
        return (self.evaluate or self.factory)(tasks)


def task_list(tasks: Sequence[Any]) -> TaskSource:
    """A task source that plays ``tasks`` in order: seed i is the i-th (for held-out evaluation)."""
    return lambda seed: tasks[seed % len(tasks)]


def environment_for(cfg) -> EnvSetup:
    """The configured environment's setup."""
    return environments.get(cfg.env)(cfg)


def task_seeds(cfg, step: int, ranks: int = 1) -> list[int]:
    """One environment seed per prompt of ``step``'s global batch (``prompts_per_step`` x ``ranks``): a pure
    function of (seed, step), whose first ``prompts_per_step`` are those of a single process."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    return [rng.randrange(2**62) for _ in range(cfg.prompts_per_step * ranks)]
