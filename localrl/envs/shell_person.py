"""The ``shell_person`` environment: the sandboxed shell, whose reward also asks a person's recorded sessions what
they would have said. ``person_sessions`` names the sessions (``localrl agent --record DIR``, or the TUI's Record
switch); the edits in them are learned as rules (``localrl.agent.edit_rules``: ``wc -l`` -> ``wc --lines``,
``timeout 10`` before every line, ...), and an episode's reward is the task's verifier less ``PERSON_WEIGHT`` x the
share of the commands it ran that the learned person would have edited. This is reinforcement learning from a
person's approvals as RLHF does it: a model of the person fitted to their decisions, then RL against it, here with the
task's verifier beside it so that pleasing the person never pays more than doing the task. Held-out success (reward
1) is a task solved with every command one the person would have approved as proposed.

The tasks, split and sandbox are the shell's built-in ones (``shell``); the expert (what ``--objective sft`` learns
from) is the shell's, each of its commands as the person's edits would have it (``wc -l`` spelt ``wc --lines``): the
person's form learned on right solutions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from localrl.agent.edit_rules import EditRules
from localrl.config import check_fields, setting
from localrl.envs import EnvSetup, environments
from localrl.envs.shell import SHELL_PRESET, ShellEnv, shell_environment, solve
from localrl.errors import UserError

PERSON_WEIGHT = 0.5  # an episode all of whose commands the person would have edited loses this much


class PersonEnv(ShellEnv):
    """The shell, whose reward takes off the share of the episode's commands ``rules`` would have edited."""

    def __init__(self, rules: EditRules, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rules = rules

    def edited_share(self) -> float:
        commands = self.stats.commands
        return sum(not self.rules.approves(c) for c in commands) / len(commands) if commands else 0.0

    def reward(self) -> float:
        return super().reward() - PERSON_WEIGHT * self.edited_share()


def revised_solve(env: PersonEnv, seed: int) -> tuple[float, list[tuple[str, str]]]:
    """The shell's expert, each command as the person's edits would have it."""
    return solve(env, seed, revise=env.rules.apply)


@dataclass
class PersonSettings:
    """a person learned from recorded sessions"""

    person_sessions: str = setting("", "env shell_person: recorded agent sessions (a directory holding "
                                       "sessions.jsonl, as localrl agent --record writes) whose edits the person's "
                                       "rules are learned from")


def check_person_settings(cfg) -> None:
    """(Called when the run selects env shell_person.)"""
    check_fields(cfg, [("person_sessions", bool(cfg.person_sessions), "env shell_person learns the "
                        "person from recorded sessions: name them (localrl agent --record DIR)")])


@environments.register("shell_person", preset=SHELL_PRESET, check_selected=check_person_settings,
                       settings=PersonSettings, about="the shell's tasks, rewarded also by a person learned from "
                                                      "person_sessions")
def shell_person_environment(cfg) -> EnvSetup:
    """The shell's setup, in ``PersonEnv`` with the rules of the sessions ``person_sessions`` names."""
    try:
        rules = EditRules.from_sessions(cfg.person_sessions)
    except UserError as e:
        raise UserError(f"config field person_sessions: {e}", field="person_sessions") from None
    if not rules.rules:
        raise UserError(f"config field person_sessions: {cfg.person_sessions}: the sessions' {rules.edits} edits "
                        f"teach no rule (env shell_person needs a person who edited some commands)",
                        field="person_sessions")
    setup = shell_environment(cfg)

    def factory(source) -> PersonEnv:
        return PersonEnv(rules, source, cfg.max_turns, cfg.env_timeout, setup.details["isolation"])

    return replace(setup, factory=factory, expert=revised_solve,
                   details={**setup.details, "person_rules": len(rules.rules)},
                   describe=f"{setup.describe}; the person: {rules.describe()}")
