"""Preference pairs, in TRL's preference formats, and the built-in task's own.

A row is ``{"prompt", "chosen", "rejected"}``, as TRL's ``DPOTrainer`` takes it:

- standard: three strings;
- conversational: the prompt a list of ``{role, content}`` messages, each completion a list holding one assistant
  message;
- implicit prompt: no ``prompt``; ``chosen`` and ``rejected`` are whole texts or conversations, and the prompt is
  their common beginning (the messages they share; for texts, the characters they share, up to a word's end).

Every row becomes ``{"prompt": str | messages, "chosen": str, "rejected": str}`` (the completions' texts), checked
before any model loads; the first bad one stops the run with one line naming its place (``file:line``). The rows are
read from any source a task's are (``localrl.data.sources``: JSONL, Parquet, CSV, JSON, Arrow, a ``save_to_disk``
directory, a cached hub id).

Recorded agent sessions (``localrl.agent.session_log``) are pairs too (``session_pairs``): a command the person edited
is a pair at that turn's state (the conversation before it), the reply with the edit chosen over the reply as
proposed; and where two sessions reached the same state and the person approved one reply and rejected another
(or a remembered rule allowed one and refused the other), the approved over the rejected.

The built-in addition task makes its own pairs: the worked solution chosen over a near miss (its carries forgotten,
or one digit of its answer slipped).
"""

from __future__ import annotations

import json

from localrl.agent.tool_calls import with_command
from localrl.data.arithmetic import parse_question, slipped_answer, worked_answer
from localrl.data.jsonl import check_prompt, last_message
from localrl.errors import UserError

def preference_row(raw: dict, where: str) -> dict:
    """A source's row as ``{"prompt", "chosen", "rejected"}`` (texts for the completions), or one line naming
    ``where`` and what is wrong."""
    for key in ("chosen", "rejected"):
        if key not in raw:
            raise UserError(f"{where}: missing '{key}' (a preference row is {{prompt, chosen, rejected}}, TRL's "
                            f"format); columns: {', '.join(map(str, raw)) or 'none'}")
    chosen, rejected = raw["chosen"], raw["rejected"]
    if "prompt" not in raw:
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected, where)
    else:
        prompt = raw["prompt"]
        check_prompt(prompt, where)
    row = {"prompt": prompt, "chosen": completion_text(chosen, where, "chosen"),
           "rejected": completion_text(rejected, where, "rejected")}
    if row["chosen"] == row["rejected"]:
        raise UserError(f"{where}: 'chosen' and 'rejected' are the same completion (no preference to learn)")
    return row


def completion_text(value, where: str, key: str) -> str:
    """A completion's text: a string, or a conversation's one assistant message."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) and \
            value[0].get("role") == "assistant" and isinstance(value[0].get("content"), str):
        text = value[0]["content"]
    else:
        raise UserError(f"{where}: '{key}' must be a string or a list of one assistant message "
                        f"([{{\"role\": \"assistant\", \"content\": ...}}])")
    if not text.strip():
        raise UserError(f"{where}: '{key}' is empty")
    return text


def _shared_length(a, b) -> int:
    """How many first items (messages, characters) ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _implicit_prompt(chosen, rejected, where: str) -> tuple:
    """(prompt, chosen, rejected) of a row without a prompt: what the two share, then what differs."""
    if isinstance(chosen, list) and isinstance(rejected, list):
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            check_prompt(value, where, key)
        shared = _shared_length(chosen, rejected)
        if shared == 0:
            raise UserError(f"{where}: no 'prompt', and 'chosen' and 'rejected' share no first message to take as "
                            f"the prompt")
        return chosen[:shared], chosen[shared:], rejected[shared:]
    if isinstance(chosen, str) and isinstance(rejected, str):
        shared = _shared_length(chosen, rejected)
        shared = chosen.rfind(" ", 0, shared + 1) + 1 if shared < len(chosen) and chosen[shared] != " " else shared
        if not chosen[:shared].strip():
            raise UserError(f"{where}: no 'prompt', and 'chosen' and 'rejected' share no beginning to take as the "
                            f"prompt")
        return chosen[:shared], chosen[shared:], rejected[shared:]
    raise UserError(f"{where}: 'chosen' and 'rejected' must both be strings or both conversations")


def builtin_pair(row: dict) -> dict:
    """The built-in addition task's pair of a ``{prompt, answer}`` row: the worked solution chosen over its near miss
    (``arithmetic.slipped_answer``: the carries forgotten, or one digit slipped)."""
    problem = parse_question(last_message(row["prompt"]))
    return {"prompt": row["prompt"], "chosen": worked_answer(problem), "rejected": slipped_answer(problem)}


def is_session(raw: dict) -> bool:
    """Whether a row is a recorded agent session (``localrl.agent.session_log``) rather than a pair."""
    return "turns" in raw and "messages" in raw


def session_pairs(sessions: list[tuple[str, dict]]) -> list[dict]:
    """The pairs of recorded sessions (``(where, record)`` each): each edit, the edited reply over the proposed one;
    and at each state (the conversation before a reply) reached by more than one session, every reply the person
    rejected under one they approved."""
    pairs, at_state = [], {}
    for where, record in sessions:
        messages, turns = record.get("messages"), record.get("turns")
        if not isinstance(messages, list) or not isinstance(turns, list):
            raise UserError(f"{where}: a session's 'messages' and 'turns' must be lists")
        for turn in turns:
            i = turn.get("message") if isinstance(turn, dict) else None
            if not isinstance(i, int) or not 0 < i < len(messages) or not isinstance(messages[i], dict) \
                    or messages[i].get("role") != "assistant" or not isinstance(messages[i].get("content"), str):
                raise UserError(f"{where}: a turn's 'message' must index one of the model's replies")
            prompt, reply = messages[:i], messages[i]["content"]
            check_prompt(prompt, where)
            decision = turn.get("decision")
            if decision == "edited" and isinstance(turn.get("command"), str):
                edited = with_command(reply, turn["command"])
                if edited != reply:
                    pairs.append({"prompt": prompt, "chosen": edited, "rejected": reply})
            kind = {"approved": "good", "allowed": "good", "rejected": "bad", "refused": "bad"}.get(decision)
            if kind is not None:
                at_state.setdefault(json.dumps(prompt, sort_keys=True), (prompt, {"good": [], "bad": []}))[1][
                    kind].append(reply)
    for prompt, replies in at_state.values():
        for bad in dict.fromkeys(replies["bad"]):
            good = next((g for g in replies["good"] if g != bad), None)
            if good is not None:
                pairs.append({"prompt": prompt, "chosen": good, "rejected": bad})
    return pairs
