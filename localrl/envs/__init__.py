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

A two-policy game is registered the same way as a ``Game`` subclass (the secret-keeping game,
``localrl.envs.secret_keeping``): the self-play sampler plays it, not the episodes one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from localrl.errors import UserError
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
    release: Callable[[], None] = lambda: None  # frees what the setup holds all run (a world model's thread)

    def make_env(self, tasks: TaskSource | None = None) -> Environment:
        return self.factory(tasks or self.train)

    def eval_env(self, tasks: TaskSource) -> Environment:
        """An environment for held-out episodes (a simulated environment's are played in the real one)."""
        return (self.evaluate or self.factory)(tasks)


class Game:
    """A two-policy game, registered as an environment (``--env NAME``) and played by the self-play sampler
    (``localrl.samplers.self_play``): the first player writes the second's user turn, the second replies, and the
    game scores both players from the reply. Each player is an adapter of its own on the one base.

    A game's setting is a dict (its seed decides it); ``held_out`` are settings with a fixed first turn
    (``"turn"``, and a ``"family"`` for a per-family report), the second player's held-out evaluation."""

    players: tuple[str, str] = ("first", "second")
    held_out_name: str = ""  # the held-out set's name and version (the evaluation records it)

    def __init__(self, cfg):
        self.cfg = cfg

    def setting(self, seed: int) -> dict:
        raise NotImplementedError

    def first_messages(self, setting: dict) -> list[dict]:
        """The first player's chat messages, to which its turn is the reply."""
        raise NotImplementedError

    def second_messages(self, setting: dict, turn: str) -> list[dict]:
        """The second player's chat messages, ``turn`` (the first player's) among them."""
        raise NotImplementedError

    def outcome(self, setting: dict, turn: str, reply: str) -> dict:
        """The game's verdict on a reply: {"rewards": (first's, second's), and the game's own figures, each in [0, 1]}."""
        raise NotImplementedError

    @property
    def held_out(self) -> list[dict]:
        return []


def is_game(name: str) -> bool:
    """Whether the environment ``name`` is a two-policy ``Game`` (one that does not resolve is not: the episodes
    sampler then says why in one line)."""
    try:
        plugin = environments.get(name)
    except UserError:
        return False
    return isinstance(plugin, type) and issubclass(plugin, Game)


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
