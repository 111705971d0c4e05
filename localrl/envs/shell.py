"""The ``shell`` environment: a task in a fresh working directory, the model's commands run in
the sandbox, and a verifier of the final file tree and answer.

A turn is the model's whole message. If it holds a tool call
(``<tool_call>{"name": "shell", "arguments": {"command": ...}}</tool_call>``, the first one
counts), the command runs and its output is the next observation; a message that tries a
tool call and gets it wrong (bad JSON, another tool, no command) is an invalid call, and the
observation says what was wrong; a message without one is the final answer and ends the
episode. The episode also ends after ``max_turns`` turns, unanswered.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from localrl.agent import parse_tool_calls
from localrl.envs.shell_tasks import FAMILIES, LEVELS, ShellTask, sample_tasks
from localrl.sandbox import Sandbox

TaskSource = Callable[[int], ShellTask]  # seed -> task


def generated_tasks(held_out: bool = False, families: Sequence[str] = FAMILIES,
                    levels: Sequence[int] = LEVELS) -> TaskSource:
    """Seed -> a generated task from one side of the held-out split."""
    return lambda seed: sample_tasks(random.Random(seed), 1, held_out, tuple(families), tuple(levels))[0]


def task_list(tasks: Sequence[ShellTask]) -> TaskSource:
    """Seed -> one of a fixed list of tasks (a user's, or the held-out set)."""
    return lambda seed: tasks[seed % len(tasks)]


@dataclass
class EpisodeStats:
    turns: int = 0
    tool_calls: int = 0
    invalid_calls: int = 0
    answered: bool = False  # ended with a final answer rather than the turn limit
    sandbox_seconds: float = 0.0


class ShellEnv:
    def __init__(self, tasks: TaskSource | None = None, max_turns: int = 4, timeout: float = 5.0,
                 isolation: str | None = None, output_limit: int = 1000, root: str | Path | None = None):
        self.tasks = tasks or generated_tasks()
        self.max_turns = max_turns
        self.timeout = timeout
        self.isolation = isolation
        self.output_limit = output_limit
        self.root = root
        self.task: ShellTask | None = None
        self.workdir: Path | None = None
        self.sandbox: Sandbox | None = None
        self.final_text = ""
        self.stats = EpisodeStats()

    def reset(self, seed: int) -> str:
        self.close()
        self.task = self.tasks(seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="localrl-shell-", dir=self.root))
        self.task.setup(self.workdir)
        self.sandbox = Sandbox(self.workdir, timeout=self.timeout, output_limit=self.output_limit,
                               isolation=self.isolation)
        self.final_text, self.stats = "", EpisodeStats()
        return self.task.instruction

    def step(self, action: str) -> tuple[str, bool]:
        if self.sandbox is None:
            raise RuntimeError("step() before reset()")
        self.stats.turns += 1
        commands = parse_tool_calls(action)
        if commands:
            self.stats.tool_calls += 1
            result = self.sandbox.run(commands[0])
            self.stats.sandbox_seconds += result.seconds
            observation = result.describe(echo=False)  # the model wrote the command: only what it printed
        elif "<tool_call>" in action:
            self.stats.invalid_calls += 1
            observation = ('error: not a valid tool call; write exactly '
                           '<tool_call>{"name": "shell", "arguments": {"command": "..."}}</tool_call>')
        else:
            self.final_text, self.stats.answered = action, True
            return "", True
        return observation, self.stats.turns >= self.max_turns

    def reward(self) -> float:
        if self.task is None or self.workdir is None:
            raise RuntimeError("reward() before reset()")
        return self.task.score(self.workdir, self.final_text)

    def close(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir = self.sandbox = None


def solve(env: ShellEnv, seed: int, slip: bool = False) -> tuple[float, list[tuple[str, str]]]:
    """Play the task's expert solution (or with ``slip``, its careless one): the reward and the
    (action, observation) turns, as a scripted agent writes them (the built-in agent model's
    pretraining trajectories come from this)."""
    env.reset(seed)
    turns = []
    for command in (env.task.slip if slip else env.task.solution):
        action = expert_call(command)
        observation, done = env.step(action)
        turns.append((action, observation))
        if done:
            break
    else:
        final = expert_answer(turns[-1][1] if turns else "", env.task)
        env.step(final)
        turns.append((final, ""))
    return env.reward(), turns


def expert_call(command: str) -> str:
    return f'<tool_call>{json.dumps({"name": "shell", "arguments": {"command": command}})}</tool_call>'


def expert_answer(last_observation: str, task: ShellTask) -> str:
    """The final message: the last command's output as the answer for a question, else "done"."""
    asks = getattr(task.check, "answer", None) is not None
    if not asks:
        return "<answer>done</answer>"
    lines = [line for line in last_observation.splitlines() if not line.startswith("[")]
    return f"<answer>{lines[-1].strip() if lines else ''}</answer>"
