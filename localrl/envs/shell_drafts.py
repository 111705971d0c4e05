"""The ``shell_drafts`` environment: draft refinement in the sandboxed shell. Each built-in shell task comes with a
draft, the commands a careless agent types for it (``ShellTask.slip``: one mistake each, most often one wrong flag or
word: ``wc -w`` for ``wc -l``, ``grep -c error`` for ``grep -c ERROR``, ``sed`` without ``-i``), to be fixed:

    How many lines are in notes.txt?
    Draft (one mistake): wc -w < notes.txt
    Fix the draft and do the task.

The reward is the task's verifier (final correctness), and a right end state pays for the draft's right parts it
changed: minus ``EDIT_WEIGHT`` x the share of the draft's right words (those the expert's commands also use) that
none of the commands run used. A wrong end state pays nothing for its edits (as ``draft_edits`` on the addition
drafts: an ungated penalty is won by copying the draft). The held-out success rate (reward 1) is the fixed-draft
rate of fixes that kept what was right. The tasks and held-out split are the shell's built-in ones (``shell_tasks``),
every family and level.
"""

from __future__ import annotations

import shlex
from dataclasses import replace

from localrl.envs import EnvSetup, environments
from localrl.envs.shell import SHELL_PRESET, ShellEnv, generated_tasks, shell_environment
from localrl.envs.shell_tasks import ShellTask, held_out_tasks

EDIT_WEIGHT = 0.5  # a right end state that changed every right part of the draft earns 1 - EDIT_WEIGHT
HEADER = "Draft (one mistake):"
FOOTER = "Fix the draft and do the task."


def with_draft(task: ShellTask) -> ShellTask:
    """``task`` whose instruction carries its careless commands as the draft to fix."""
    return replace(task, instruction=f"{task.instruction}\n{HEADER} {' && '.join(task.slip)}\n{FOOTER}")


def words(commands) -> list[str]:
    """The shell words of ``commands``, all of them in order."""
    out = []
    for command in commands:
        try:
            out += shlex.split(command)
        except ValueError:  # unbalanced quotes: the plain words
            out += command.split()
    return out


def changed_share(task: ShellTask, ran: list[str]) -> float:
    """The share of the draft's right words (its words the expert's commands also use) that no command in ``ran``
    used; 0 for a draft with none."""
    expert = set(words(task.solution))
    right = [w for w in words(task.slip) if w in expert]
    used = set(words(ran))
    return sum(w not in used for w in right) / len(right) if right else 0.0


class DraftEnv(ShellEnv):
    """The shell, whose reward of a right end state takes off the draft's right parts the episode's commands
    changed."""

    def reward(self) -> float:
        score = super().reward()
        return score - EDIT_WEIGHT * changed_share(self.task, self.stats.commands) if score == 1.0 else score


@environments.register("shell_drafts", preset=SHELL_PRESET,  # (env_tasks: the shell check refuses it here)
                       about="the shell's tasks, each with a draft with one mistake to fix")
def shell_drafts_environment(cfg) -> EnvSetup:
    """The shell's setup (sandbox, system message, expert), its built-in tasks drafted, in ``DraftEnv``."""
    setup = shell_environment(cfg)
    tasks = generated_tasks()

    def factory(source) -> DraftEnv:
        return DraftEnv(source, cfg.max_turns, cfg.env_timeout, setup.details["isolation"])

    def train(seed: int) -> ShellTask:
        return with_draft(tasks(seed))

    return replace(setup, train=train, held_out=[with_draft(t) for t in held_out_tasks(cfg.eval_size)],
                   factory=factory, expert_tasks=lambda: train, describe=f"{setup.describe}; drafts to fix")
