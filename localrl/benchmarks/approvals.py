"""Learning from a person's approvals, measured: a scripted person (``localrl.agent.scripted_person``) works with the
agent on training tasks in the real sandbox while the sessions are recorded, DPO trains on the recorded sessions
(``--objective dpo --sampler preferences --data SESSIONS``), and the agent before and after works with the same person
on held-out tasks (names it never saw): the share of its proposed commands the person approves as they are, and the
tasks it solves.

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
              max_turns: int = 4, max_tokens: int = 64) -> dict:
    """The agent ``source`` on each task with a fresh ``ScriptedPerson`` holding ``rule`` (recorded to ``log`` if
    given): the share of proposals approved as proposed, the share of tasks solved, the mean score, and per family."""
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
                                 approvals=Approvals(workdir, store=scratch / "approvals.json"), log=log)
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


def bench_approvals(source: str, out: str | Path, rule: str = "timeout", sessions: int = 200, held_out: int = 100,
                    steps: int = 15, prompts_per_step: int = 16, lr: float = 1e-3, beta: float = 0.1,
                    loss_type: str = "sigmoid,sft", seed: int = 0, print_fn=print) -> dict:
    """The whole experiment; the sessions and the trained run are kept under ``out``."""
    from localrl.config import TrainConfig
    from localrl.runs import Run, is_run
    from localrl.training.loop import train

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
    # a run's policy trains on from its adapter (the reference: its base, the adapter off, as TRL's with a PEFT model)
    start = {"model": Run.open(source).read_config().model, "init_adapter": source} if is_run(source) else {
        "model": source}
    cfg = TrainConfig(**start, objective="dpo", sampler="preferences", data=str(log.directory), beta=beta,
                      loss_type=loss_type, steps=steps, prompts_per_step=prompts_per_step, lr=lr, seed=seed,
                      eval_size=32, run_dir=str(out / "run")).validate()
    result = train(cfg, log=lambda *_: None)
    pairs = [r["accuracy"] if r else None for r in (result.eval_before, result.eval_after)]
    print_fn(f"trained {steps} DPO steps on the sessions' pairs in {time.time() - t0:.0f} s" + (
        f": held-out preference accuracy {pairs[0]:.1%} -> {pairs[1]:.1%}" if None not in pairs else ""))
    t0 = time.time()
    after = work_with(str(out / "run"), held, rule)
    print_fn(f"held-out after: {after['approval_rate']:.1%} of {after['proposals']} proposals approved, "
             f"{after['success']:.1%} of {held_out} tasks solved ({time.time() - t0:.0f} s)")
    print_fn(f"first proposals approved: {before['approval_rate']:.1%} -> {after['approval_rate']:.1%} "
             f"({100 * (after['approval_rate'] - before['approval_rate']):+.1f} points); task success "
             f"{before['success']:.1%} -> {after['success']:.1%} "
             f"({100 * (after['success'] - before['success']):+.1f} points)")
    return {"recorded": recorded, "before": before, "after": after, "pairs_accuracy": pairs}
