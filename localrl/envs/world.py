"""The ``world`` environment: the shell's tasks, with a language model in place of the shell.

``--env world:SOURCE`` plays the built-in shell tasks, but no command runs: each tool call goes to the world model
``SOURCE`` names (``localrl.envs.world_models``: a built-in model such as ``tiny-shell-world``, a model or run
directory, a GGUF, an OpenAI-compatible endpoint), asked in the fixed format of ``localrl.envs.world_format``:
the files it believes the working directory holds and the command; it answers with the output the agent sees and
the files' changes, and the environment keeps the files it answered as the state of the next question. So the
simulation needs no sandbox and runs wherever the model runs.

The reward is the task's own verifier, run on the files the world model believes in (written to a scratch
directory that nothing executes) and the agent's answer: the same verifier as the real shell's, of the simulated
state. The held-out evaluation is NOT simulated: it plays the held-out tasks in the real sandbox, so a run's
before and after are what the agent does in reality.

A reply that is not in the format (or a request that failed) is counted in the step record (``world_unparsed``,
``world_failed``), and the first of each run is shown on stderr; that step goes on with no output and no change to
the files. Before any model loads, the world model is asked one question; if that reply cannot be read, the run
stops there in one line.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

from localrl.envs import EnvSetup, environments
from localrl.envs.shell import SHELL_PRESET, EpisodeStats, TaskSource, shell_environment, take_turn
from localrl.envs.shell_tasks import ShellTask
from localrl.envs.tree import remove_tree
from localrl.envs.world_format import Tree, WorldReplyError, apply, parse_answer, write_tree
from localrl.envs.world_models import WorldModel, open_world_model
from localrl.errors import UserError

NO_REPLY = "\n[exit code 0]"  # what a step whose reply could not be read shows the agent: no output, no change


@dataclass
class WorldStats(EpisodeStats):
    counts: dict = field(default_factory=lambda: {"world_unparsed": 0, "world_failed": 0})


class Warner:
    """Says once per run, on stderr, what the first unreadable reply was."""

    def __init__(self, name: str):
        self.name, self._said, self._lock = name, False, threading.Lock()

    def __call__(self, why: str, reply: str | None) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
        shown = "no reply" if reply is None else f"reply {reply[:80]!r}"
        print(f"localrl: warning: world model {self.name}: {why} ({shown}); counted in the step record "
              f"(world_unparsed / world_failed), the step goes on with no output and no change", file=sys.stderr)


class WorldEnv:
    """One episode of a shell task, simulated by ``world``."""

    def __init__(self, world: WorldModel, tasks: TaskSource, max_turns: int = 4, warn: Warner | None = None):
        self.world, self.tasks, self.max_turns = world, tasks, max_turns
        self.warn = warn or Warner(world.name)
        self.task: ShellTask | None = None
        self.tree: Tree = {}
        self.final_text = ""
        self.stats = WorldStats()

    def reset(self, seed: int) -> str:
        self.task = self.tasks(seed)
        self.tree = apply({}, dict(self.task.files), [])
        self.final_text, self.stats = "", WorldStats()
        return self.task.instruction

    def step(self, action: str) -> tuple[str, bool]:
        if self.task is None:
            raise RuntimeError("step() before reset()")
        return take_turn(self, action, self._simulate)

    def _simulate(self, command: str) -> str:
        reply = self.world.ask(self.tree, command)
        if reply is None:
            self.stats.counts["world_failed"] += 1
            self.warn(f"no reply ({why_none(self.world)})", None)
            return NO_REPLY
        try:
            observation, written, removed = parse_answer(reply)
        except WorldReplyError as e:
            self.stats.counts["world_unparsed"] += 1
            self.warn(f"a reply not in the world format: {e}", reply)
            return NO_REPLY
        self.tree = apply(self.tree, written, removed)
        return observation

    def reward(self) -> float:
        """The task's verifier, on the simulated files (written to a scratch directory) and the final answer."""
        if self.task is None:
            raise RuntimeError("reward() before reset()")
        root = Path(tempfile.mkdtemp(prefix="localrl-world-"))
        try:
            write_tree(self.tree, root)
            return self.task.score(root, self.final_text)
        finally:
            remove_tree(root)

    def close(self) -> None:
        pass


def why_none(world: WorldModel) -> str:
    """Why ``world`` gave no reply: its endpoint's last error, else the only other cause."""
    return getattr(world, "last_error", "") or "the question does not fit its context"


def probe(world: WorldModel, task: ShellTask) -> None:
    """Ask ``world`` about the first command of ``task``'s expert solution: a reply that does not come or cannot
    be read stops the run in one line."""
    tree = apply({}, dict(task.files), [])
    command = task.solution[0] if task.solution else "ls"
    reply = world.ask(tree, command)
    where = f"config field env: world model {world.name}"
    if reply is None:
        raise UserError(f"{where}: no reply to a first question ({why_none(world)})", field="env")
    try:
        parse_answer(reply)
    except WorldReplyError as e:
        raise UserError(f"{where}: its reply to a first question ({command!r}) is not in the world format: {e} "
                        f"(reply {reply[:80]!r})", field="env") from None


# the shell's preset; every episode's question at once (threads waiting on the world model cost nothing), so that a
# torch world model answers a round of turns in one batch
WORLD_PRESET = {**SHELL_PRESET, "env_workers": 64}


@environments.register("world", preset=WORLD_PRESET, argument="SOURCE",
                       about="the shell's tasks in a shell simulated by the world model SOURCE: tiny-shell-world, a "
                             "model, run or GGUF, or an endpoint URL|MODEL; held out in the real sandbox")
def world_environment(cfg) -> EnvSetup:
    """The shell's built-in tasks and held-out set, simulated by the world model the env's SOURCE names; the
    held-out evaluation in the real sandbox."""
    from localrl.generation.endpoint import EndpointSettings

    source = environments.argument(cfg.env)
    shell = shell_environment(cfg)  # the tasks, the held-out set, the real sandbox
    world = open_world_model(source, EndpointSettings.of(cfg))
    probe(world, shell.train(0))
    warn = Warner(world.name)

    def factory(tasks: TaskSource) -> WorldEnv:
        return WorldEnv(world, tasks, cfg.max_turns, warn)

    memory = world.memory_bytes() if hasattr(world, "memory_bytes") else 0
    return replace(shell, factory=factory, evaluate=shell.factory, memory=memory,
                   details={"world": world.name, "held_out_in": "sandbox"}, release=world.close,
                   describe=f"simulated by world model {world.name}; held-out evaluation in the real sandbox "
                            f"({shell.describe})")
