"""OpenAI's tool loop over a model that writes ``<tool_call>`` blocks: ``ToolMessages`` rewrites the messages a
client sends back (its tool calls and results) into what the model's chat template renders, and ``ToolCalls``
moves the blocks of a reply into OpenAI's ``tool_calls`` field, streamed or not."""

from __future__ import annotations

import json
import re
from typing import Any

from localrl.agent.tool_calls import parse_calls, tool_response, without_tool_calls
from localrl.serving.asgi import CHAT, json_object, read_body, replayer

class ToolMessages:
    """ASGI middleware: the messages of an OpenAI tool loop as the model learned them. A client sends back the
    assistant's turn exactly as it came (``content`` null or absent, ``tool_calls`` set), then ``tool`` messages
    with the results. llama-cpp-python's request models refuse a null content, and a chat template without tool
    support renders neither field. So, for a template that does not render ``tool_calls``, an assistant turn
    gets its calls back as the ``<tool_call>`` blocks the model wrote (what ToolCalls took out of its reply),
    and, for one without a ``tool`` role, a tool result becomes the user turn in ``<tool_response>`` tags that
    localrl's agents are trained on. A null or absent content becomes empty text.
    """

    def __init__(self, app, template: str) -> None:
        self.app = app
        self.renders_calls = "tool_calls" in template
        self.tool_role = bool(re.search(r"""['"]tool['"]""", template))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("path") != CHAT:
            return await self.app(scope, receive, send)
        body = await read_body(receive)
        request = json_object(body)
        messages = request.get("messages") if request is not None else None
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            rewritten = [self.message(m) for m in messages]
            if rewritten != messages:
                body = json.dumps({**request, "messages": rewritten}).encode()
        await self.app(scope, replayer(body, receive), send)

    def message(self, m: dict) -> dict:
        if m.get("role") == "assistant":
            calls = m.get("tool_calls") or []
            content = m.get("content") if isinstance(m.get("content"), str) else ""
            if calls and not self.renders_calls:
                content += "".join(f"<tool_call>{json.dumps(_call_of(c))}</tool_call>" for c in calls)
                m = {k: v for k, v in m.items() if k != "tool_calls"}
            return {**m, "content": content}
        if m.get("role") == "tool" and not self.tool_role and isinstance(m.get("content"), str):
            return tool_response(m["content"])
        return m


def _call_of(call) -> dict:
    """An OpenAI ``tool_calls`` entry as the model writes it: ``{"name": ..., "arguments": {...}}``."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return {"name": "", "arguments": {}}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {"name": function.get("name", ""), "arguments": arguments}


class ToolCalls:
    """ASGI middleware: a chat completion asked for with ``tools`` returns the model's
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in OpenAI's ``tool_calls`` field,
    with ``finish_reason`` "tool_calls" and the rest of the text as the content, as OpenAI clients expect.
    Streamed, each call is one ``delta.tool_calls`` entry, sent once its closing tag has arrived; text that
    may be the start of a tag is held back until it is known not to be. The chat template needs no tool
    support for this: localrl's agents write the Hermes/Qwen tags.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("path") != CHAT:
            return await self.app(scope, receive, send)
        body = await read_body(receive)
        replay = replayer(body, receive)
        request = json_object(body)
        if not (request is not None and request.get("tools")):
            return await self.app(scope, replay, send)
        if request.get("stream"):
            return await self.app(scope, replay, _StreamedToolCalls(send))
        start, chunks = None, []

        async def capture(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            data = b"".join(chunks)
            if start["status"] == 200:
                data = _with_tool_calls(data)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})

        await self.app(scope, replay, capture)


class _StreamedToolCalls:
    """The ``send`` of a streamed chat completion with tools: server-sent events in, the same events out
    with each choice's ``<tool_call>`` blocks moved from ``delta.content`` to ``delta.tool_calls``."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, send) -> None:
        self.send = send
        self.ok = False
        self.buffer = b""
        self.pending: dict[int, str] = {}  # per choice: text held back
        self.calls: dict[int, int] = {}  # per choice: tool calls sent

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.ok = message["status"] == 200
            return await self.send(message)
        if message["type"] != "http.response.body" or not self.ok:
            return await self.send(message)
        self.buffer += message.get("body", b"")
        out = []
        while cut := _event_end(self.buffer):
            end, sep = cut
            event, self.buffer = self.buffer[:end], self.buffer[end + len(sep):]
            out.append(self._event(event.decode(), sep.decode()))
        more = message.get("more_body", False)
        if not more and self.buffer:
            out.append(self._event(self.buffer.decode(), ""))
            self.buffer = b""
        await self.send({"type": "http.response.body", "body": "".join(out).encode(), "more_body": more})

    def _event(self, event: str, sep: str) -> str:
        data = event[len("data: "):] if event.startswith("data: ") else None
        try:
            chunk = json.loads(data) if data is not None else None
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            return event + sep
        events = []
        for choice in chunk["choices"]:
            i = choice.get("index", 0)
            delta = choice.get("delta") or {}
            text = self.pending.get(i, "") + (delta.get("content") or "")
            finished = choice.get("finish_reason") is not None
            pieces, self.pending[i] = self._split(i, text, finished)
            extra = {k: v for k, v in delta.items() if k != "content"}  # the role, in the first chunk
            for kind, value in pieces:
                part = {**extra, "content": value} if kind == "text" else {**extra, "tool_calls": [value]}
                extra = {}
                events.append({**chunk, "choices": [{**choice, "delta": part, "finish_reason": None}]})
            if finished or extra:
                reason = choice.get("finish_reason")
                if finished and self.calls.get(i):
                    reason = "tool_calls"
                events.append({**chunk, "choices": [{**choice, "delta": extra, "finish_reason": reason}]})
        return "".join(f"data: {json.dumps(e)}{sep or chr(10) * 2}" for e in events)

    def _split(self, i: int, text: str, finished: bool) -> tuple[list[tuple[str, Any]], str]:
        """(pieces to send now: ("text", str) or ("call", tool-call delta), the text to hold back)."""
        pieces: list[tuple[str, Any]] = []
        while True:
            start = text.find(self.OPEN)
            if start < 0:
                break
            end = text.find(self.CLOSE, start)
            if end < 0:
                break
            if start:
                pieces.append(("text", text[:start]))
            block, text = text[start:end + len(self.CLOSE)], text[end + len(self.CLOSE):]
            calls = parse_calls(block)
            if not calls:  # malformed: it stays text, as the model wrote it
                pieces.append(("text", block))
                continue
            name, args = calls[0]
            index = self.calls.get(i, 0)
            self.calls[i] = index + 1
            pieces.append(("call", {"index": index, "id": f"call_{index}", "type": "function",
                                    "function": {"name": name, "arguments": json.dumps(args)}}))
        if finished:
            hold = 0
        elif (start := text.find(self.OPEN)) >= 0:
            hold = len(text) - start  # an open block: wait for its end
        else:  # the longest ending that could start a tag
            hold = next((k for k in range(len(self.OPEN) - 1, 0, -1) if text.endswith(self.OPEN[:k])), 0)
        if len(text) > hold:
            pieces.append(("text", text[:len(text) - hold]))
        return pieces, text[len(text) - hold:]


def _event_end(buffer: bytes) -> tuple[int, bytes] | None:
    """(where the first complete server-sent event ends, its separator), or None."""
    found = [(buffer.find(sep), sep) for sep in (b"\r\n\r\n", b"\n\n") if sep in buffer]
    return min(found) if found else None


def _with_tool_calls(data: bytes) -> bytes:
    try:
        response = json.loads(data)
    except ValueError:
        return data
    for choice in response.get("choices", []):
        message = choice.get("message") or {}
        text = message.get("content") or ""
        calls = parse_calls(text)
        if not calls:
            continue
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(args)}}
                                 for i, (name, args) in enumerate(calls)]
        message["content"] = without_tool_calls(text) or None
        choice["finish_reason"] = "tool_calls"
    return json.dumps(response).encode()
