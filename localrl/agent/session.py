"""One task for an agent in a real working directory, each command shown to the user first.

The model's turns stream from a ``ChatModel`` (a GGUF, a run or a model); a tool call is
checked against the working directory's remembered decisions (``approvals.py``: allowed and
denied prefixes, dangerous patterns always asked), then run in the sandbox, or refused, and the
result goes back to the model as the next message, as in training. ``localrl agent`` drives it
from a terminal.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from localrl.agent.approvals import Approvals
from localrl.agent.session_log import Episode, SessionLog
from localrl.agent.tool_calls import parse_tool_calls, system_message, tool_response
from localrl.envs.sandbox import Sandbox
from localrl.errors import UserError
from localrl.visible import visible

# ask(command, why) -> ("run", command as edited) | ("reject", None) | ("always", prefix) | ("never", prefix)
Ask = Callable[[str, str], tuple[str, str | None]]


def agent_system(setting: str, source: str) -> str | None:
    """The system message for an agent session: "auto" gives the tool-call instructions ("") except to a
    built-in model, a run of one or a GGUF exported from either, which learned the protocol without a
    system message (None)."""
    from localrl.models import builtin_path
    from localrl.runs import Run

    if setting == "none":
        return None
    if setting != "auto":
        return setting
    base = str(source)
    if base.endswith(".gguf") and Path(base).is_file():
        from localrl.quant.gguf_info import read_gguf_info

        base = Path(read_gguf_info(base).name or "x").name  # the exported model's source directory
    elif Path(base).is_dir() and Run(base).config_path.is_file():
        base = Run.open(base).saved("model")
    return None if builtin_path(base) is not None else ""


def check_workdir(workdir: str | Path, force: bool = False) -> Path:
    """The agent's working directory, resolved. Refused: what is not a directory and, without ``force``, ``/``,
    the user's home directory and any folder holding it, where one careless ``rm -r *`` the user approves would
    take everything."""
    path = Path(workdir).expanduser()
    if not path.is_dir():
        raise UserError(f"agent --workdir {workdir}: not a directory")
    path = path.resolve()
    home = Path.home().resolve()
    if not force and (path == Path(path.anchor) or path == home or path in home.parents):
        what = "the root directory" if path == Path(path.anchor) else (
            "your home directory" if path == home else f"a folder holding your home directory ({home})")
        raise UserError(f"agent --workdir {workdir}: is {what}; give the agent a project folder (or pass "
                        f"--force-workdir to allow it)")
    return path


def run_agent(model, task: str, workdir: str | Path, ask: Ask, out: TextIO = sys.stdout, max_turns: int = 8,
              max_tokens: int = 256, timeout: float = 30.0, system: str | None = "",
              approvals: Approvals | None = None, force_workdir: bool = False, log: SessionLog | None = None,
              rate: Callable[[], int | None] | None = None, revise: Callable[[str], str] | None = None) -> list[dict]:
    """Work on ``task`` until the model answers without a tool call or ``max_turns`` turns pass; returns
    the conversation. ``system``: "" for the standard instructions (naming ``workdir``), None for none.
    ``force_workdir``: allow ``/`` or the home directory (``check_workdir``). ``log``: record the episode there
    (each proposal, the decision, the output; ``rate()``: the person's rating at the end, or None). ``revise``: the
    harness's edit of each command the model proposes before anyone is asked (``edit_rules.EditRules.apply``: what the
    person's past edits would make of it), which the person is asked about; the conversation keeps the model's reply
    as it wrote it, as it does when the person edits (the model reads the revised command's output)."""
    check_workdir(workdir, force_workdir)
    sandbox = Sandbox(workdir, timeout=timeout)
    approvals = approvals or Approvals(workdir)
    messages = [system_message(str(sandbox.workdir))] if system == "" else (
        [{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": task})
    out.write(f"[sandbox: {sandbox.isolation}, as {sandbox.runs_as}; working directory {sandbox.workdir}]\n")
    episode = None
    if log is not None:
        out.write(f"[{log.describe()}]\n")
        episode = log.begin(task, getattr(model, "name", ""), sandbox.workdir)
    _work(model, messages, sandbox, approvals, ask, out, max_turns, max_tokens, episode, revise)
    if episode is not None:
        log.end(episode, messages, rate() if rate is not None else None)
    return messages


def _work(model, messages: list[dict], sandbox: Sandbox, approvals: Approvals, ask: Ask, out: TextIO,
          max_turns: int, max_tokens: int, episode: Episode | None, revise: Callable[[str], str] | None) -> None:
    """The agent's turns, appended to ``messages`` (and recorded in ``episode``)."""
    for _ in range(max_turns):
        reply = []
        out.write("agent: ")
        for delta in model.stream(messages, max_tokens=max_tokens, temperature=0.0):
            reply.append(delta)
            out.write(visible(delta))
            out.flush()
        out.write("\n")
        text = "".join(reply)
        messages.append({"role": "assistant", "content": text})
        commands = parse_tool_calls(text)
        if not commands:
            if "<tool_call>" in text:
                messages.append(tool_response('error: not a valid tool call; write exactly <tool_call>{"name": '
                                              '"shell", "arguments": {"command": "..."}}</tool_call>'))
                continue
            break
        command = proposed = commands[0]
        reply_at = len(messages) - 1
        if revise is not None and (revised := revise(command)) != command:
            out.write(f"[revised by your past edits: {visible(revised, command=True)}]\n")
            command = proposed = revised  # (the conversation keeps the model's reply, as it does a person's edit)
        decision, why = approvals.decide(command)
        if decision == "ask":
            action, value = ask(command, why)
            if action in ("always", "never") and value:
                approvals.remember(value, allow=action == "always")
                decision = "allow" if action == "always" else "deny"
            elif action == "run" and value:
                command, decision = value, "allow"
            else:
                decision = "deny"
            outcome = "rejected" if decision == "deny" else ("approved" if command == proposed else "edited")
        else:
            out.write(f"[{'allowed' if decision == 'allow' else 'refused'}: {why}]\n")
            outcome = "allowed" if decision == "allow" else "refused"
        if decision == "deny":
            messages.append(tool_response("The user refused to run this command. Try something else."))
            if episode is not None:
                episode.turn(reply_at, proposed, outcome, None)
            continue
        result = sandbox.run(command)
        out.write(visible(result.describe()) + "\n")
        messages.append(tool_response(result.describe(echo=False)))
        if episode is not None:
            episode.turn(reply_at, proposed, outcome, command, result.exit_code, result.describe(echo=False))


def terminal_ask(stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> Ask:
    """Approval prompts on a terminal: y runs, n rejects, e edits, a/d always allow/deny a prefix. The command is
    shown whole, with every character that acts on a terminal written out (``localrl.visible``); one of several
    lines is shown as a block."""
    def ask(command: str, why: str) -> tuple[str, str | None]:
        first = command.split()[0] if command.split() else command
        shown, shown_first = visible(command, command=True), visible(first, command=True)
        if "\n" in shown:
            shown = "this command:\n" + "".join(f"  | {line}\n" for line in shown.split("\n"))
        else:
            shown = f"`{shown}`"
        while True:
            out.write(f"run {shown}? ({why})  [y]es [n]o [e]dit [a]lways allow `{shown_first}` "
                      f"[d]eny `{shown_first}` always: ")
            out.flush()
            answer = stdin.readline()
            if not answer:
                return "reject", None
            choice = answer.strip().lower()[:1]
            if choice == "y":
                return "run", command
            if choice in ("n", ""):
                return "reject", None
            if choice == "e":
                out.write("command: ")
                out.flush()
                edited = stdin.readline().strip()
                return ("run", edited) if edited else ("reject", None)
            if choice == "a":
                return "always", first
            if choice == "d":
                return "never", first
    return ask


def terminal_rating(stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> Callable[[], int | None]:
    """The rating asked at the end of a recorded session: 1 to 5, or Enter for none."""
    def rate() -> int | None:
        while True:
            out.write("rate this session from 1 (useless) to 5 (just right), or Enter to skip: ")
            out.flush()
            answer = stdin.readline().strip()
            if not answer:
                return None
            if answer in ("1", "2", "3", "4", "5"):
                return int(answer)
    return rate
