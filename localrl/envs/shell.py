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
import math
import os
import random
import stat
import tempfile
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from localrl.agent.tool_calls import parse_tool_calls
from localrl.envs import EnvSetup, environments, quota_fs, task_list
from localrl.envs.sandbox import DISK_QUOTA, ISOLATION, Sandbox, level_works, strongest_level
from localrl.envs.tree import remove_stale, remove_tree, walk
from localrl.envs.shell_tasks import (FAMILIES, LEVELS, Check, ShellTask, call_with_timeout, held_out_tasks,
                                      sample_tasks)
from localrl.envs.task_files import load_tasks
from localrl.errors import UserError, failure_line

TaskSource = Callable[[int], ShellTask]  # seed -> task
WORKDIR_PREFIX = "localrl-shell-"  # then the owning process's pid: stale ones are swept


def generated_tasks(held_out: bool = False, families: Sequence[str] = FAMILIES,
                    levels: Sequence[int] = LEVELS) -> TaskSource:
    """Seed -> a generated task from one side of the held-out split."""
    return lambda seed: sample_tasks(random.Random(seed), 1, held_out, tuple(families), tuple(levels))[0]


@dataclass
class EpisodeStats:
    turns: int = 0
    tool_calls: int = 0
    invalid_calls: int = 0
    answered: bool = False  # ended with a final answer rather than the turn limit
    sandbox_seconds: float = 0.0
    commands: list[str] = field(default_factory=list)  # the commands run, in order


class ShellEnv:
    def __init__(self, tasks: TaskSource | None = None, max_turns: int = 4, timeout: float = 5.0,
                 isolation: str | None = None, output_limit: int = 1000, root: str | Path | None = None,
                 disk_quota: int = DISK_QUOTA):
        self.tasks = tasks or generated_tasks()
        self.max_turns = max_turns
        self.timeout = timeout
        self.isolation = isolation
        self.output_limit = output_limit
        self.root = root
        self.disk_quota = disk_quota
        self.own_file_system = False  # the last episode's directory is a file system of the quota's size
        sweep_stale_workdirs(root)
        self.task: ShellTask | None = None
        self.workdir: Path | None = None
        self.sandbox: Sandbox | None = None
        self.final_text = ""
        self.stats = EpisodeStats()
        self._progress: float | None = None  # the share of the verifier's checks met after the last turn

    def reset(self, seed: int) -> str:
        self.close()
        self.task = self.tasks(seed)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-", dir=self.root))
        self._cleanup = weakref.finalize(self, remove_workdir, self.workdir)  # also at exit, Ctrl-C included
        self.own_file_system = quota_fs.mount(self.workdir, self.disk_quota)
        self.task.setup(self.workdir)
        self.sandbox = Sandbox(self.workdir, timeout=self.timeout, output_limit=self.output_limit,
                               max_disk_bytes=self.disk_quota, isolation=self.isolation, private_workdir=True)
        self.final_text, self.stats = "", EpisodeStats()
        self._progress = None
        if isinstance(self.task.check, Check):
            try:  # what the starting state already meets (a check that cannot run fails in reward(), as it did)
                self._progress = self.task.score(self.workdir, "")
            except Exception:  # noqa: BLE001 - then this episode gives no turn rewards
                self._progress = None
        return self.task.instruction

    def step(self, action: str) -> tuple[str, bool]:
        if self.sandbox is None:
            raise RuntimeError("step() before reset()")
        return take_turn(self, action, self._run)

    def _run(self, command: str) -> str:
        result = self.sandbox.run(command)
        self.stats.sandbox_seconds += result.seconds
        return result.describe(echo=False)  # the model wrote the command: only what it printed

    def reward(self) -> float:
        if self.task is None or self.workdir is None:
            raise RuntimeError("reward() before reset()")
        if not isinstance(self.task.check, Check):
            disarm(self.workdir)  # a user's verifier may follow links or open FIFOs; the built-in one does neither
        return self.task.score(self.workdir, self.final_text)

    def turn_reward(self) -> float | None:
        """The last turn's process reward: how much it raised the share of the verifier's checks the episode meets
        (its files, and its answer once given), so the turns' rewards add up to what the episode met beyond the
        starting state. None for a task with a user's verifier (running it after every turn is the user's call,
        not ours)."""
        if self.task is None or self.workdir is None or self._progress is None:
            return None
        progress = self.task.score(self.workdir, self.final_text)
        reward, self._progress = progress - self._progress, progress
        return reward

    def state(self) -> dict:
        """What a user's process reward (``process_reward``) reads after a turn: the task's instruction, the working
        directory (on the host, disarmed: read it, never run what is in it), the turns taken, and the final
        answer once given."""
        if self.task is None or self.workdir is None:
            raise RuntimeError("state() before reset()")
        disarm(self.workdir)
        return {"instruction": self.task.instruction, "workdir": self.workdir, "turns": self.stats.turns,
                "answer": self.final_text if self.stats.answered else None}

    def close(self) -> None:
        if self.workdir is not None:
            self._cleanup()
        self.workdir = self.sandbox = None


def take_turn(env, action: str, run: Callable[[str], str]) -> tuple[str, bool]:
    """One turn of the shell's protocol on ``env`` (its ``stats``, ``max_turns``, ``final_text``): a tool call's
    command goes to ``run`` (command -> observation), a bad tool call is told what was wrong, anything else is the
    final answer and ends the episode."""
    env.stats.turns += 1
    commands = parse_tool_calls(action)
    if commands:
        env.stats.tool_calls += 1
        env.stats.commands.append(commands[0])
        observation = run(commands[0])
    elif "<tool_call>" in action:
        env.stats.invalid_calls += 1
        observation = ('error: not a valid tool call; write exactly '
                       '<tool_call>{"name": "shell", "arguments": {"command": "..."}}</tool_call>')
    else:
        env.final_text, env.stats.answered = action, True
        return "", True
    return observation, env.stats.turns >= env.max_turns


def disarm(root: Path) -> None:
    """Remove what the model's commands left that could make reading the tree touch the host or
    block: FIFOs, sockets, device nodes, and links that lead outside ``root`` or nowhere (at any depth:
    ``tree.walk``; a link whose target cannot be resolved counts as leading out)."""
    real_root = os.path.realpath(root)

    def stays_inside(fd: int, name: str) -> bool:
        target = os.path.realpath(f"/proc/self/fd/{fd}/{name}")  # the directory held open, not a path to it
        inside = os.path.commonpath([target, real_root]) == real_root
        return inside and (os.path.isfile(target) or os.path.isdir(target))

    def visit(fd: int, name: str, st: os.stat_result, where: str) -> None:
        mode = st.st_mode
        try:
            if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode) and stays_inside(fd, name):
                return
            os.unlink(name, dir_fd=fd)
        except OSError:
            pass

    for _ in range(3):  # the command has ended; a leftover process could still move directories about
        try:
            walk(root, visit)
            return
        except OSError:
            continue


def remove_workdir(workdir: Path) -> bool:
    """Remove an episode's directory, its own file system unmounted first; whether it is gone. Never raises."""
    if quota_fs.mounted(workdir):
        quota_fs.unmount(workdir)
    return remove_tree(workdir)


def sweep_stale_workdirs(root: str | Path | None = None) -> None:
    """Remove episode directories left by localrl processes that are gone (killed, crashed), unmounting their file
    systems. Never raises: what cannot be removed stays."""
    remove_stale(root or tempfile.gettempdir(), WORKDIR_PREFIX, remove=remove_workdir)


VERIFIER_PROBE_SECONDS = 10.0  # a verifier slower than this on one episode would stall every step
PROBE_SOLUTIONS = 16  # expert solutions played in the preflight (about 0.1 s each); later tasks: starting files


def probe_verifiers(spec: str, tasks: list[ShellTask], isolation: str, timeout: float) -> None:
    """Call each of a user's tasks' verifiers once, as the trainer's preflight probes rewards: on the end state of
    its expert solution (played in the sandbox) when it has one, for the first ``PROBE_SOLUTIONS`` such tasks,
    else on the unchanged starting files with an empty answer. A verifier that raises, returns what is not a
    finite number or takes more than ``VERIFIER_PROBE_SECONDS`` stops the run here, in one line naming the task."""
    played = 0
    for i, task in enumerate(tasks, 1):
        named = f"tasks {spec}: task {i} ({task.instruction[:40]!r})"
        solution = task.solution if played < PROBE_SOLUTIONS else ()
        played += bool(solution)
        env = ShellEnv(task_list([task]), len(solution) + 1, timeout, isolation)
        try:
            try:
                env.reset(0)
            except Exception as e:  # noqa: BLE001 - the user's starting files
                raise UserError(f"{named}: its starting files cannot be made: {failure_line(e)}",
                                field="env_tasks") from None
            observation = ""
            for command in solution:
                observation, _ = env.step(expert_call(command))
            final = expert_answer(observation, task) if solution else ""
            verifier = task.check.score if isinstance(task.check, Check) else task.check
            what = f"{named}: its verifier, on " + ("the end state of its expert solution" if solution else
                                                     "the unchanged starting files")
            finished, value, error = call_with_timeout(verifier, (env.workdir, final), VERIFIER_PROBE_SECONDS)
        finally:
            env.close()
        if not finished:
            raise UserError(f"{what}, did not return within {VERIFIER_PROBE_SECONDS:g} s", field="env_tasks")
        if error is not None:
            raise UserError(f"{what}, failed: {failure_line(error)}", field="env_tasks")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UserError(f"{what}, returned {value!r}, not a number", field="env_tasks") from None
        if not math.isfinite(number):
            raise UserError(f"{what}, returned {number}: a score must be a finite number in [0, 1]",
                            field="env_tasks")


def solve(env: ShellEnv, seed: int, slip: bool = False,
          revise: Callable[[str], str] | None = None) -> tuple[float, list[tuple[str, str]]]:
    """Play the task's expert solution (or with ``slip``, its careless one; each command as ``revise`` makes it):
    the reward and the (action, observation) turns, as a scripted agent writes them (the built-in agent model's
    pretraining trajectories come from this)."""
    env.reset(seed)
    turns = []
    for command in (env.task.slip if slip else env.task.solution):
        action = expert_call(revise(command) if revise is not None else command)
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


def check_shell_settings(cfg) -> None:
    """The shell environment's own fields: its tasks, the built-in generator's families and levels, the sandbox."""
    from localrl.config import check_fields, unknown_items

    built_in = cfg.env == "shell" and not cfg.env_tasks
    check_fields(cfg, [
        ("env_families", not unknown_items(cfg.env_families, FAMILIES),
         f"must be a comma-separated subset of {', '.join(FAMILIES)}"),
        ("env_levels", not unknown_items(cfg.env_levels, tuple(map(str, LEVELS))),
         f"must be a comma-separated subset of {', '.join(map(str, LEVELS))}"),
        *[(name, not getattr(cfg, name) or built_in,
           "applies to the built-in shell tasks (env = 'shell', no env_tasks)") for name in ("env_families", "env_levels")],
        ("env_timeout", cfg.env_timeout > 0, "must be positive"),
        ("isolation", cfg.isolation in ISOLATION, f"must be one of {', '.join(ISOLATION)}"),
    ])


# `--env shell` brings the built-in agent model and sizes that train it on a 2-core CPU, unless the file or the
# flags set them
SHELL_PRESET = {"model": "tiny-shell", "steps": 30, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 48,
                "beta": 0.0, "eval_size": 100, "save_every": 10}


@environments.register("shell", preset=SHELL_PRESET, check=check_shell_settings, owns=("env_tasks",),
                       about="shell tasks run in the sandbox, scored by verifiers of the final files and answer")
def shell_environment(cfg) -> EnvSetup:
    """The sandboxed shell: the built-in task generator (``env_families``, ``env_levels``) or the user's tasks
    (``env_tasks``: a JSONL file or module:function, whose verifiers are probed here), the strongest sandbox
    isolation that works (or ``isolation``'s, checked), the agent's system message."""
    from localrl.agent.session import agent_system
    from localrl.agent.tool_calls import system_message
    from localrl.config import split_list

    if cfg.isolation == "auto":
        isolation = strongest_level()
    elif not level_works(cfg.isolation):
        raise UserError(f"config field isolation: {cfg.isolation} does not work on this machine", field="isolation")
    else:
        isolation = cfg.isolation
    system = agent_system(cfg.system_prompt, cfg.model)  # an agent session's, naming no directory nor approver
    system = system_message(None, approvals=False)["content"] if system == "" else system

    def factory(tasks: TaskSource) -> ShellEnv:
        return ShellEnv(tasks, cfg.max_turns, cfg.env_timeout, isolation)

    quota = (f"its own {DISK_QUOTA // 2**20} MiB file system" if quota_fs.possible() else
             f"{DISK_QUOTA // 2**20} MiB, measured every 20 ms")
    common = dict(factory=factory, system=system, details={"isolation": isolation},
                  describe=f"sandbox isolation: {isolation}, each episode's disk {quota}", expert=solve)
    if not cfg.env_tasks:
        families = tuple(split_list(cfg.env_families)) or FAMILIES
        levels = tuple(int(lv) for lv in split_list(cfg.env_levels)) or LEVELS
        train = generated_tasks(False, families, levels)
        return EnvSetup(train, held_out_tasks(cfg.eval_size), expert_tasks=lambda: train, **common)
    tasks = load_tasks(cfg.env_tasks)
    if not cfg.env_tasks.endswith(".jsonl"):  # a file's checks are data, checked as it loads
        probe_verifiers(cfg.env_tasks, tasks, isolation, cfg.env_timeout)
    held = [t for t in tasks if t.is_held_out()]
    train_tasks = [t for t in tasks if not t.is_held_out()] or tasks

    def with_solutions() -> TaskSource:  # a warm start learns from the solutions
        solved = [t for t in train_tasks if t.solution]
        if not solved:
            raise UserError(f"config field env_tasks: {cfg.env_tasks}: no training task has a \"solution\" (the "
                            f"expert's commands) for sft to learn from", field="env_tasks")
        return _draw(solved)

    return EnvSetup(_draw(train_tasks), held[:cfg.eval_size], expert_tasks=with_solutions, **common)


def _draw(tasks: list[ShellTask]) -> TaskSource:
    return lambda seed: tasks[random.Random(seed).randrange(len(tasks))]
