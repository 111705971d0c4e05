"""The terminal-agent protocol: how a model asks for a shell command and how it hears the result.

The model writes Hermes/Qwen-style tool calls, which instruct models of that lineage already
produce:

    <tool_call>{"name": "shell", "arguments": {"command": "ls -la"}}</tool_call>

and each result comes back in the next user turn inside ``<tool_response>`` tags (a plain
user message, so any chat template can carry it). Running the command, and asking the user
first, is the caller's business (``localrl.envs.sandbox``, the TUI's Agent screen).
"""

from __future__ import annotations

import json
import re

SYSTEM_PROMPT = """You are a terminal agent working in {where}.
To run a shell command, write exactly one tool call and stop:
<tool_call>{{"name": "shell", "arguments": {{"command": "COMMAND"}}}}</tool_call>
{approval}Its output comes back inside <tool_response> tags.
When the task is done, answer without a tool call; put any value the task asks for inside <answer></answer>."""

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def system_message(workdir: str | None = None, approvals: bool = True) -> dict:
    """The agent's instructions; training episodes name no directory (every episode has its own, and a
    prompt shared by a group must be the same text) and have no one to approve."""
    where = f"the directory {workdir}" if workdir else "the task's working directory"
    approval = "The user approves or rejects every command. " if approvals else ""
    return {"role": "system", "content": SYSTEM_PROMPT.format(where=where, approval=approval)}


def parse_calls(text: str) -> list[tuple[str, dict]]:
    """Every well-formed tool call in ``text`` as (name, arguments); malformed ones are skipped."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        args = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(args, str):  # some models encode the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                continue
        if isinstance(call.get("name"), str) and isinstance(args, dict):
            calls.append((call["name"], args))
    return calls


def parse_tool_calls(text: str) -> list[str]:
    """The shell commands requested in ``text``; malformed calls are skipped."""
    return [args["command"] for name, args in parse_calls(text)
            if name == "shell" and isinstance(args.get("command"), str) and args["command"].strip()]


def without_tool_calls(text: str) -> str:
    """``text`` with its tool-call blocks removed."""
    return _TOOL_CALL.sub("", text).strip()


def tool_response(text: str) -> dict:
    """A command's result (or the user's refusal) as the next user turn."""
    return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}


def with_command(text: str, command: str) -> str:
    """``text`` with its first tool call replaced by a shell call of ``command`` (what the model would have written
    to propose it: a person's edit of its proposal)."""
    call = '<tool_call>{"name": "shell", "arguments": {"command": ' + json.dumps(command) + '}}</tool_call>'
    found = _TOOL_CALL.search(text)
    return text + call if found is None else text[:found.start()] + call + text[found.end():]
