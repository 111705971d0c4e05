"""Learning from a person's approvals, measured: a scripted person (``localrl.agent.scripted_person``) works with the
agent on training tasks in the real sandbox while the sessions are recorded, the agent learns from the recorded
sessions by one of ``LEARNERS``, and the agent before and after works with the same person on held-out tasks (names
it never saw): the share of its proposed commands the person approves as they are, and the tasks it solves.

``LEARNERS``, each from the same sessions:

- ``rpo``: DPO plus the chosen reply's NLL on the sessions' pairs (``--objective dpo --sampler preferences --data
  SESSIONS --loss-type sigmoid,sft``): the edit chosen over the proposal;
- ``rl``: GRPO in the sandboxed shell against a model of the person learned from the sessions' edits (``--env
  shell_person --person-sessions SESSIONS``: the task's verifier less the share of commands the learned person
  would edit);
- ``sft``: the supervised warm start on the shell expert's solutions in the person's form, as the learned person
  writes them (``--objective sft --env shell_person``);
- ``harness``: no training; the agent session revises each proposal as the learned person would
  (``localrl agent --follow-edits SESSIONS``).

Each session is what ``localrl agent --record`` does: ``run_agent`` in a fresh working directory holding the task's
files, every command asked about (no remembered rule), greedy decoding; the task's verifier scores the directory and
the final answer (success: every condition met).
"""

from __future__ import annotations

import io
import random
import shutil
import tempfile
import time
from pathlib import Path

from localrl.agent.approvals import Approvals
from localrl.agent.scripted_person import RULES, ScriptedPerson
from localrl.agent.session import agent_system, run_agent
from localrl.agent.session_log import SessionLog
from localrl.agent.tool_calls import parse_tool_calls
from localrl.envs.shell_tasks import ShellTask, held_out_tasks, sample_tasks


def work_with(source: str, tasks: list[ShellTask], rule: str = "timeout", log: SessionLog | None = None,
              max_turns: int = 4, max_tokens: int = 64, revise=None) -> dict:
    """The agent ``source`` on each task with a fresh ``ScriptedPerson`` holding ``rule`` (recorded to ``log`` if
    given; ``revise``: the harness's edit of each proposal, ``run_agent``'s): the share of proposals approved as
    proposed, the share of tasks solved, the mean score, and per family."""
    from localrl.serving.chat import EndsWhenFull, open_chat_model

    model, person = EndsWhenFull(open_chat_model(source)), ScriptedPerson(RULES[rule])
    system = agent_system("auto", source)
    solved, scores, families = 0, 0.0, {}
    scratch = Path(tempfile.mkdtemp(prefix="localrl-approvals-"))
    try:
        for i, task in enumerate(tasks):
            workdir = scratch / f"task-{i}"
            workdir.mkdir()
            task.setup(workdir)
            asked, approved = person.asked, person.approved
            messages = run_agent(model, task.instruction, workdir, person.ask, out=io.StringIO(),
                                 max_turns=max_turns, max_tokens=max_tokens, system=system,
                                 approvals=Approvals(workdir, store=scratch / "approvals.json"), log=log,
                                 revise=revise)
            last = messages[-1]
            answer = last["content"] if last["role"] == "assistant" and not parse_tool_calls(last["content"]) else ""
            score = task.score(workdir, answer)
            solved += score == 1.0
            scores += score
            family = families.setdefault(task.family, {"asked": 0, "approved": 0, "tasks": 0, "solved": 0})
            family["asked"] += person.asked - asked
            family["approved"] += person.approved - approved
            family["tasks"] += 1
            family["solved"] += score == 1.0
            shutil.rmtree(workdir, ignore_errors=True)
    finally:
        model.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return {"tasks": len(tasks), "proposals": person.asked, "approval_rate": person.approval_rate,
            "success": solved / len(tasks), "mean_score": scores / len(tasks), "families": families}


def _start(source: str) -> dict:
    """A run's policy trains on from its adapter (the reference: its base, the adapter off, as TRL's with a PEFT
    model); anything else from itself."""
    from localrl.runs import Run, is_run

    return {"model": Run.open(source).saved("model"), "init_adapter": source} if is_run(source) else {
        "model": source}


def _train(source: str, out: Path, settings: dict, overrides: dict):
    """A run under ``out/run`` from ``source`` with ``settings`` (a smaller test's ``overrides`` over them)."""
    from localrl.config import TrainConfig
    from localrl.training.loop import train

    cfg = TrainConfig(**{**_start(source), **settings, "run_dir": str(out / "run"), **overrides}).validate()
    return train(cfg, log=lambda *_: None)


def learn_rpo(source: str, sessions: Path, out: Path, steps: int, seed: int, print_fn=print,
              **overrides) -> tuple[str, None]:
    """RPO (DPO + the chosen's NLL, 16 pairs a step, lr 1e-3, beta 0.1) on the sessions' pairs."""
    result = _train(source, out, {"objective": "dpo", "sampler": "preferences", "data": str(sessions), "beta": 0.1,
                                  "loss_type": "sigmoid,sft", "steps": steps, "prompts_per_step": 16, "lr": 1e-3,
                                  "seed": seed, "eval_size": 32}, overrides)
    pairs = [r["accuracy"] if r else None for r in (result.eval_before, result.eval_after)]
    if None not in pairs:
        print_fn(f"held-out preference accuracy {pairs[0]:.1%} -> {pairs[1]:.1%}")
    return str(out / "run"), None


def learn_rl(source: str, sessions: Path, out: Path, steps: int, seed: int, print_fn=print,
             **overrides) -> tuple[str, None]:
    """GRPO in ``shell_person`` (the shell's preset: 8 tasks x 8 episodes a step; its lr) against the person learned
    from the sessions."""
    _train(source, out, {"env": "shell_person", "person_sessions": str(sessions), "steps": steps, "seed": seed,
                         "eval_size": 0}, overrides)
    return str(out / "run"), None


def learn_sft(source: str, sessions: Path, out: Path, steps: int, seed: int, print_fn=print,
              **overrides) -> tuple[str, None]:
    """The supervised warm start (8 tasks a step, its lr) on the shell expert's solutions in the person's form, as
    the rules learned from the sessions' edits write them (``--objective sft --env shell_person``)."""
    _train(source, out, {"objective": "sft", "env": "shell_person", "person_sessions": str(sessions), "steps": steps,
                         "seed": seed, "eval_size": 0}, overrides)
    return str(out / "run"), None


def learn_harness(source: str, sessions: Path, out: Path, steps: int, seed: int, print_fn=print,
                  **overrides) -> tuple[str, object]:
    """No training: the person's edits as rules the session applies to each proposal."""
    from localrl.agent.edit_rules import EditRules

    rules = EditRules.from_sessions(sessions)
    print_fn(f"the harness follows {rules.describe()}: " + "; ".join(r.describe() for r in rules.rules))
    return source, rules.apply


# (source, sessions, out, steps, seed, print_fn, **config fields for a smaller run) -> (the agent after, its revise)
LEARNERS = {"rpo": learn_rpo, "rl": learn_rl, "sft": learn_sft, "harness": learn_harness}


def bench_approvals(source: str, out: str | Path, rule: str = "timeout", sessions: int = 200, held_out: int = 100,
                    learn: str = "rpo", steps: int = 15, seed: int = 0, print_fn=print) -> dict:
    """The whole experiment; the sessions and the trained run are kept under ``out``."""
    out = Path(out)
    log = SessionLog(out / "sessions")
    held = held_out_tasks(held_out)
    t0 = time.time()
    recorded = work_with(source, sample_tasks(random.Random(f"approvals-{seed}"), sessions), rule, log)
    print_fn(f"recorded {sessions} sessions with the person ({recorded['proposals']} proposals, "
             f"{recorded['approval_rate']:.1%} approved as proposed) in {time.time() - t0:.0f} s: {log.path}")
    t0 = time.time()
    before = work_with(source, held, rule)
    print_fn(f"held-out before: {before['approval_rate']:.1%} of {before['proposals']} proposals approved, "
             f"{before['success']:.1%} of {held_out} tasks solved ({time.time() - t0:.0f} s)")
    t0 = time.time()
    agent, revise = LEARNERS[learn](source, log.directory, out, steps, seed, print_fn)
    print_fn(f"learned from the sessions ({learn}) in {time.time() - t0:.0f} s")
    t0 = time.time()
    after = work_with(agent, held, rule, revise=revise)
    print_fn(f"held-out after: {after['approval_rate']:.1%} of {after['proposals']} proposals approved, "
             f"{after['success']:.1%} of {held_out} tasks solved ({time.time() - t0:.0f} s)")
    print_fn(f"first proposals approved: {before['approval_rate']:.1%} -> {after['approval_rate']:.1%} "
             f"({100 * (after['approval_rate'] - before['approval_rate']):+.1f} points); task success "
             f"{before['success']:.1%} -> {after['success']:.1%} "
             f"({100 * (after['success'] - before['success']):+.1f} points)")
    return {"learn": learn, "recorded": recorded, "before": before, "after": after}
