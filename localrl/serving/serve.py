"""Serve a GGUF over an OpenAI-compatible HTTP API through llama-cpp-python.

It runs llama-cpp-python's own server (FastAPI + uvicorn), loopback only unless ``--host`` says
otherwise, with an optional API key (``Authorization: Bearer KEY``; the scheme in any case; from ``--api-key-file``,
$LOCALRL_API_KEY or ``--api-key``). Routes:

- ``POST /v1/chat/completions`` (streaming and not), formatted by the chat template stored in the
  GGUF, the one localrl's export writes from the tokenizer (it takes text content, not content parts);
- ``POST /v1/completions`` (streaming and not; also at ``/v1/engines/copilot-codex/completions``),
  one prompt per request;
- ``GET /v1/models``; ``POST /extras/tokenize``, ``/extras/tokenize/count`` and ``/extras/detokenize``;
- ``POST /v1/embeddings`` is refused with a 404 JSON error: the model is loaded for generation, not embeddings;
- FastAPI's ``/docs`` and ``/openapi.json`` describe llama-cpp-python's API, refused route included (with a key set,
  they need it too).

Checked before the model loads, each a one-line UserError: ``--port`` (1-65535), ``--n-ctx`` (0, the
default, is the context the GGUF says the model was trained for, else 2048), that a ``--host`` other than
loopback has a key (or ``--insecure``, which warns), the GGUF header, and that the port is free (the socket
bound then is the one served on).

Checked per request before anything reads its body (the Gate, which says why): the Host header (403), the
key (401, whatever the body), the body's size (413; 4 MiB unless ``--max-body-bytes``) and its JSON nesting
(400). No CORS headers, so no web page can use the server, unless ``--cors-origin`` names the page's origin;
llama-cpp-python's own CORS, which lets every origin in, is taken out.

Checked per request before llama-cpp-python sees it, each a 400 JSON error: the body (JSON, sent with a
JSON Content-Type) against the server's own request models, and what llama.cpp would crash on or silently
ignore: an unparsable grammar, token ids outside the vocabulary, several prompts, an empty prompt the model
cannot start from, ``n`` or ``best_of`` other than 1, ``max_tokens`` outside 1 to the context. A prompt longer
than the context gets a 400 ``context_length_exceeded``, streamed or not.

No response carries a traceback or a file path: any other failure is a JSON 500
``{"error": {"message": "internal error: ...", "type": "server_error"}}``; the details go to the server's log.
"""

from __future__ import annotations

import email.message
import errno
import hmac
import ipaddress
import json
import logging
import os
import re
import socket
import stat
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from localrl.agent.tool_calls import parse_calls, tool_response, without_tool_calls
from localrl.errors import UserError
from localrl.quant.gguf_info import read_gguf_info
from localrl.quant.runtime import require_llama_cpp_server
from localrl.serving.limits import RequestLimits

if TYPE_CHECKING:
    from llama_cpp import Llama

DEFAULT_N_CTX = 2048  # for a GGUF that does not say which context it was trained for
CHAT = "/v1/chat/completions"
COMPLETIONS = ("/v1/completions", "/v1/engines/copilot-codex/completions")
MAX_BODY_BYTES = 4 * 1024 * 1024  # a request's body; a whole 32k-token chat is some 200 KB of JSON
MAX_JSON_DEPTH = 64  # arrays and objects within each other in a request; a tool's JSON schema needs a dozen
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})  # the Host names of a loopback server
API_KEY_ENV = "LOCALRL_API_KEY"
REFUSED = {"/v1/embeddings": "embeddings are not served by this model (it is loaded for text generation only)"}

_CONTEXT_EXCEEDED = re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)")
# a file path: a drive or slash then two or more components, or three components joined by slashes
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.~+-]+){2,}|[\w.~+-]+(?:[\\/][\w.~+-]+){2,}")
_log = logging.getLogger("uvicorn.error")  # uvicorn's own error log, shown at the server's log level


def _error(message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> dict:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [*(headers or []), (b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _one_line(text: str) -> str:
    """The first line of an error message, with file paths replaced and no traceback in it."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith("Traceback"):
        lines = lines[-1:]  # a traceback ends with the exception itself
    line = _PATH.sub("<path>", lines[0])[:300] if lines else ""
    if not line or "Traceback" in line or 'File "' in line:
        return "see the server log"
    return line


def _leaks(text: str) -> bool:
    return "Traceback" in text or 'File "' in text or _PATH.search(text) is not None


class GuardErrors:
    """ASGI middleware: no response carries a traceback or a file path, and no failure goes unanswered.

    llama-cpp-python answers its route exceptions with a 500 whose message is ``str(exception)``, which for
    FastAPI's validation errors names the handler's source file, and anything it does not catch becomes a
    plain-text 500 or a dropped connection. A streamed completion that fails before its first chunk (a prompt
    over the context) has already said 200 and then sends nothing. So the response start is held until the
    first body bytes, 5xx bodies (and any error body with a traceback or a path) are rewritten, and an
    exception becomes an OpenAI-style JSON error; the details go to the server's log.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: dict | None = None  # the response start, not yet sent
        error_body: list[bytes] | None = None  # an error response's body, collected to be checked
        started = finished = False  # whether the client got the response start, and its last body
        sse = False  # whether the response is an event stream

        async def guarded_send(message) -> None:
            nonlocal held, error_body, started, finished, sse
            if message["type"] == "http.response.start":
                held, error_body = message, [] if message["status"] >= 400 else None
                sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                          for k, v in message.get("headers", []))
                return
            if message["type"] != "http.response.body" or held is None:
                finished = finished or not message.get("more_body", False)
                return await send(message)
            more = message.get("more_body", False)
            if error_body is not None:
                error_body.append(message.get("body", b""))
                if more:
                    return
                start, body, held = held, b"".join(error_body), None
                started = finished = True
                replacement = _checked_error(start["status"], body)
                if replacement is None:
                    await send(start)
                    return await send({"type": "http.response.body", "body": body})
                kept = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-type",
                                                                                        b"content-length")]
                return await _send_json(send, start["status"], replacement, kept)
            if not message.get("body"):
                # nothing to say yet, or an end with nothing said: a stream whose generator failed first ends
                # like this before the exception arrives, so the status stays open until the app returns
                return
            start, held, started, finished = held, None, True, not more
            await send(start)
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except Exception as e:
            status, body = _error_for(e, scope.get("path", ""))
            if status >= 500 or started:  # the details of a failure go to the log, as they would without this
                _log.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=e)
            if finished:
                return
            if started:  # mid-stream: the status is out; end the stream, with an error event if it is one
                error = _error(f"internal error: {_describe(e)}", "server_error")
                event = b"data: " + json.dumps(error).encode() + b"\n\n" if sse else b""
                return await send({"type": "http.response.body", "body": event, "more_body": False})
            return await _send_json(send, status, body)
        if held is not None:  # an empty response, held above
            await send(held)
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error_for(e: Exception, path: str) -> tuple[int, dict]:
    """The status and body for an exception that escaped llama-cpp-python's handlers."""
    over = _CONTEXT_EXCEEDED.search(str(e))
    if over:  # raised inside a stream, where llama-cpp-python's own 400 for it cannot reach
        tokens, window = over.groups()
        message = f"This model's maximum context length is {window} tokens; the prompt has {tokens}. " \
                  "Please shorten the prompt."
        return 400, _error(message, param="messages" if path == CHAT else "prompt", code="context_length_exceeded")
    return 500, _error(f"internal error: {_describe(e)}", "server_error")


def _describe(e: Exception) -> str:
    return _one_line(str(e)) if str(e).strip() else type(e).__name__  # an assert fails with no message


def _checked_error(status: int, body: bytes) -> dict | None:
    """The body to send instead of an error response's, or None to send it as it is."""
    text = body.decode("utf-8", "replace")
    if status < 500 and not _leaks(text):
        return None
    message = text
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            message = inner["message"]
        elif isinstance(parsed.get("detail"), str):
            message = parsed["detail"]
    if status >= 500:
        return _error(f"internal error: {_one_line(message)}", "server_error")
    return _error(_one_line(message))


async def _read_body(receive, limit: int | None = None) -> bytes | None:
    """A request's whole body (a middleware that reads it hands it on with ``_replayer``), or None as soon as it
    passes ``limit`` bytes: the rest is left unread."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            return None
        chunks.append(chunk)  # joined once at the end: adding each chunk to the body copies it all again
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replayer(body: bytes, receive):
    """A ``receive`` for the app that gives ``body`` first, then whatever the client sends next."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _header(scope, name: bytes) -> str | None:
    """A request header's value (the first, if it is sent twice), or None."""
    value = next((v for k, v in scope.get("headers") or [] if k.lower() == name), None)
    return None if value is None else value.decode("latin-1")


_BRACKETS = np.isin(np.arange(256), list(b"[]{}"))  # [256]: whether a byte is a bracket


def json_depth(body: bytes) -> int:
    """How deeply a JSON text nests arrays and objects (brackets inside strings do not count), found without
    recursion: Python's parser recurses once a level, so 100,000 ``[`` raise a RecursionError in it. Vectorised:
    a quote is escaped when an odd run of backslashes ends right before it, a bracket is in a string when an odd
    number of unescaped quotes comes before it."""
    text = np.frombuffer(body, np.uint8)
    quotes, slashes = np.flatnonzero(text == ord('"')), np.flatnonzero(text == ord("\\"))  # [positions]
    if len(quotes) and len(slashes):
        new_run = np.ones(len(slashes), bool)
        new_run[1:] = slashes[1:] != slashes[:-1] + 1
        starts, ends = slashes[new_run], slashes[np.append(new_run[1:], True)]  # [backslash runs]
        run = np.minimum(np.searchsorted(ends, quotes - 1), len(ends) - 1)  # the run that may end before each quote
        quotes = quotes[~((ends[run] == quotes - 1) & ((quotes - starts[run]) % 2 == 1))]
    brackets = np.flatnonzero(_BRACKETS[text])
    if len(quotes):
        brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]  # outside strings
    steps = np.where(text[brackets] & 2, 1, -1)  # +1 opens, -1 closes: of the four, only "[" and "{" have bit 2 set
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def _nests_deeper(body: bytes, limit: int) -> bool:
    if body.count(b"[") + body.count(b"{") <= limit:  # it cannot: the usual request is done here
        return False
    return json_depth(body) > limit


class Gate:
    """ASGI middleware, the first to see a request: what the request must pass before any part of the server reads
    its body. In order:

    - its Host header names this server (else a 403): a web page that a DNS rebinding points at this address sends
      its own domain name. Served: the ``--host`` address, ``localhost``, ``127.0.0.1`` and ``[::1]`` for a loopback
      or wildcard bind, any IP address for a wildcard bind (a page sends one only when it came from this server),
      and the ``--allowed-host`` names;
    - the CORS headers and preflight answers of the ``--cors-origin`` origins, and for no other origin (by default
      none: no web page may read the server's answers or send it JSON);
    - the API key (else a 401, the body unread);
    - a body of at most ``max_body`` bytes (else a 413: at once for a Content-Length over it, and a chunked body is
      cut off as it passes the limit; the rest is never read into memory);
    - JSON nested at most MAX_JSON_DEPTH deep (else a 400, before any parser recurses into it).

    The body, read once and whole, is handed on to the app.
    """

    def __init__(self, app, hosts: frozenset[str], any_address: bool, api_key: str | None,
                 max_body: int = MAX_BODY_BYTES, cors_origins: tuple[str, ...] = (),
                 max_headers: int = RequestLimits.max_headers) -> None:
        self.app, self.hosts, self.any_address, self.api_key, self.max_body = app, hosts, any_address, api_key, max_body
        self.max_headers = max_headers
        self.admit = self._admit
        if cors_origins:
            from starlette.middleware.cors import CORSMiddleware

            self.admit = CORSMiddleware(self._admit, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                        allow_headers=["Authorization", "Content-Type"])

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if len(scope.get("headers") or []) > self.max_headers:
            return await _send_json(send, 431, _error(
                f"headers: over the server's limit of {self.max_headers} (max_headers, its --max-headers; got "
                f"{len(scope['headers'])})", code="headers_too_large"))
        host = _header(scope, b"host")  # (HTTP/1.0 may leave it out; a browser never does)
        if host is not None and not self.host_allowed(host):
            name = _host_name(host)
            return await _send_json(send, 403, _error(
                f"Host {name!r} is not served here (start the server with --allowed-host {name} to serve it)",
                code="host_not_allowed"))
        await self.admit(scope, receive, send)

    def host_allowed(self, header: str) -> bool:
        name = _host_name(header)
        return name in self.hosts or (self.any_address and _address(name) is not None)

    def authorized(self, scope) -> bool:
        """Whether the request carries the key: ``Authorization: Bearer KEY``, the scheme in any case (RFC 7235)."""
        if not self.api_key:
            return True
        scheme, _, credentials = (_header(scope, b"authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode("latin-1"),
                                                                  self.api_key.encode("latin-1", "replace"))

    async def _admit(self, scope, receive, send) -> None:
        if not self.authorized(scope):
            return await _send_json(send, 401, _error("invalid API key (send Authorization: Bearer KEY)",
                                                      code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body:
            return await self._too_large(send)
        body = await _read_body(receive, self.max_body)
        if body is None:
            return await self._too_large(send)
        if _nests_deeper(body, MAX_JSON_DEPTH):
            return await _send_json(send, 400, _error(f"body: JSON nested more than {MAX_JSON_DEPTH} levels deep",
                                                      param="body"))
        await self.app(scope, _replayer(body, receive), send)

    async def _too_large(self, send) -> None:
        # what the client still sends uvicorn reads and drops (it keeps nothing), so a client that sends the whole
        # body before it reads the answer gets the 413; uvicorn closes the connection instead if the request said
        # "Connection: close"
        message = f"body: over the server's limit of {self.max_body} bytes (its --max-body-bytes)"
        await _send_json(send, 413, _error(message, param="body", code="request_too_large"))


def _host_name(header: str) -> str:
    """The host in a Host header: lower case, without the port, an IPv6 address without its brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        name = header[1:header.find("]")] if "]" in header else header
    else:
        name = header.rpartition(":")[0] if ":" in header else header
    return name.rstrip(".")


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``name`` as an IP address (an IPv6 one with or without brackets), or None if it is not one."""
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def _is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every address: ``0.0.0.0``, ``::``."""
    address = _address(host)
    return host in ("", "*") or (address is not None and address.is_unspecified)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` listens on this machine only."""
    address = _address(host)
    return host.lower() == "localhost" or (address is not None and address.is_loopback)


def served_hosts(host: str, allowed: tuple[str, ...] = ()) -> tuple[frozenset[str], bool]:
    """The names a Host header may give to a server bound to ``host``, and whether any IP address is one too."""
    names = {_host_name(f"[{host.strip('[]')}]" if ":" in host else host), *(_host_name(a) for a in allowed)}
    wildcard = _is_wildcard(host)
    if wildcard or is_loopback(host):
        names |= LOOPBACK_NAMES
    return frozenset(names), wildcard


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
        body = await _read_body(receive)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        messages = request.get("messages") if isinstance(request, dict) else None
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            rewritten = [self.message(m) for m in messages]
            if rewritten != messages:
                body = json.dumps({**request, "messages": rewritten}).encode()
        await self.app(scope, _replayer(body, receive), send)

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
        body = await _read_body(receive)
        replay = _replayer(body, receive)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not (isinstance(request, dict) and request.get("tools")):
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


class ValidateRequests:
    """ASGI middleware: a request llama-cpp-python would fail on gets a 400 JSON error, a refused route a 404.

    llama-cpp-python's route handler reports request validation failures as internal errors (with its source
    path in the message); this checks the body against the server's own request models first. With the loaded
    ``llama`` it also checks what llama.cpp would crash the process on (a token id outside the vocabulary for
    detokenize, a grammar that does not parse) or silently ignore (logit_bias for such a token id).
    """

    def __init__(self, app, llama: Llama | None = None, alias: str = "model", n_ctx: int = DEFAULT_N_CTX,
                 limits: RequestLimits = RequestLimits()) -> None:
        from llama_cpp.server.types import (CreateChatCompletionRequest, CreateCompletionRequest,
                                            DetokenizeInputRequest, TokenizeInputRequest)

        self.app, self.llama, self.alias, self.n_ctx, self.limits = app, llama, alias, n_ctx, limits
        self.models = {CHAT: CreateChatCompletionRequest, **{p: CreateCompletionRequest for p in COMPLETIONS},
                       "/extras/tokenize": TokenizeInputRequest, "/extras/tokenize/count": TokenizeInputRequest,
                       "/extras/detokenize": DetokenizeInputRequest}
        # a model whose tokenizer adds no BOS has nothing to evaluate for an empty prompt (an assertion fails)
        self.empty_prompt_ok = llama is None or bool(llama.tokenize(b""))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # (the Gate has checked the key)
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path in REFUSED:
            return await _send_json(send, 404, _error(REFUSED[path], code="not_served"))
        if scope["method"] != "POST" or path not in self.models:
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        problem = self.problem(path, body, scope)
        if problem is not None:
            where, text = problem
            return await _send_json(send, 400, _error(f"{where}: {text}", param=where))
        if path == CHAT or path in COMPLETIONS:
            # llama-cpp-python names the model in a response by the request's "model", else by its file's path:
            # every response names the served alias instead, so none carries a path
            request = json.loads(body)
            request["model"] = self.alias
            body = json.dumps(request).encode()
        replay = _replayer(body, receive)
        await self.app(scope, replay, send)

    @staticmethod
    def json_content_type(scope) -> bool:
        """Whether FastAPI will read the body as JSON: its Content-Type is application/json or application/*+json."""
        value = _header(scope, b"content-type") or ""
        message = email.message.Message()
        message["content-type"] = value
        subtype = message.get_content_subtype()
        return bool(value) and message.get_content_maintype() == "application" and (subtype == "json" or
                                                                                   subtype.endswith("+json"))

    def problem(self, path: str, body: bytes, scope) -> tuple[str, str] | None:
        """What is wrong with a request body, as (parameter, message), or None."""
        from pydantic import ValidationError

        if not self.json_content_type(scope):  # else FastAPI fails to read the body, a 500 naming its source file
            return "body", "must be JSON, sent with Content-Type: application/json"
        try:
            request = self.models[path].model_validate_json(body)
        except ValidationError as e:
            first = e.errors()[0]
            return ".".join(str(x) for x in first.get("loc", ())) or "body", str(first.get("msg"))
        if path in COMPLETIONS:
            prompt = request.prompt
            if isinstance(prompt, list) and len(prompt) > 1:  # llama-cpp-python asserts one
                return "prompt", f"one prompt per request (got {len(prompt)})"
            if not (prompt[0] if isinstance(prompt, list) and prompt else prompt) and not request.suffix \
                    and not self.empty_prompt_ok:
                return "prompt", "must not be empty"
            if request.best_of not in (None, 1):  # else ignored
                return "best_of", f"must be 1: one completion is generated per request (got {request.best_of})"
        if path == CHAT or path in COMPLETIONS:
            if request.n not in (None, 1):  # else ignored: one choice comes back whatever n asks for
                return "n", f"must be 1: one completion is generated per request (got {request.n})"
            # 0 or less would be taken as "up to the end of the context", and more than the context cannot be
            if request.max_tokens is not None and not 1 <= request.max_tokens <= self.n_ctx:
                return "max_tokens", f"must be 1 to {self.n_ctx} (the context length) or left out " \
                                     f"(got {request.max_tokens})"
            if over := self.limits.problem(json.loads(body)):  # before llama.cpp parses any of it
                return over
        if self.llama is None:
            return None
        n_vocab = self.llama.n_vocab()
        if path == "/extras/detokenize":
            bad = next((t for t in request.tokens if not 0 <= t < n_vocab), None)
            if bad is not None:  # llama.cpp aborts the whole process on it
                return "tokens", f"token id {bad} is not in the model's vocabulary (0-{n_vocab - 1})"
        if path == CHAT or path in COMPLETIONS:
            if request.logit_bias and request.logit_bias_type != "tokens":  # else ignored, with a log line each step
                for key in request.logit_bias:
                    if not 0 <= _token_id(key) < n_vocab:
                        return "logit_bias", f"token id {key!r} is not in the model's vocabulary (0-{n_vocab - 1})"
            if request.grammar and not self.grammar_parses(request.grammar):  # else llama.cpp crashes on it
                return "grammar", "not a valid GBNF grammar with a root rule"
        return None

    def grammar_parses(self, grammar: str) -> bool:
        """Whether llama.cpp accepts a grammar: it returns no sampler for one it cannot parse."""
        import llama_cpp

        vocab = getattr(getattr(self.llama, "_model", None), "vocab", None)
        if vocab is None:  # llama-cpp-python moved it: leave the grammar to llama.cpp
            return True
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if not sampler:
            return False
        llama_cpp.llama_sampler_free(sampler)
        return True


def _token_id(key: str) -> int:
    """A logit_bias key as llama-cpp-python reads it (``int(key)``); -1 if it is not a number."""
    try:
        return int(key)
    except ValueError:
        return -1


def _bound_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) the way uvicorn binds one, or a UserError saying why it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"serve: port {port} on {host} is in use (another server? choose a port with --port)") \
                from None
        raise UserError(f"serve: cannot listen on {host} port {port} ({e.strerror or e})") from None
    return sock


MAX_KEY_FILE_BYTES = 4096  # a key file holds one key


def read_secret_file(path: str | Path, where: str, warn: Callable[[str], Any] = print) -> str:
    """The text of a file that holds a secret: a regular file (a FIFO would block, a device never end) of at most
    ``MAX_KEY_FILE_BYTES``, opened without blocking; a warning if other users may read it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise UserError(f"{where}: cannot read it ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{where}: not a regular file (a FIFO, device or directory cannot hold a key)")
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise UserError(f"{where}: {st.st_size} bytes; a key file holds one key (at most {MAX_KEY_FILE_BYTES})")
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        warn(f"warning: {where} can be read by other users (mode {stat.S_IMODE(st.st_mode):o}); "
             f"chmod 600 {path}")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise UserError(f"{where}: not text") from None


def api_key_from(key: str | None = None, key_file: str | Path | None = None,
                 environ: Mapping[str, str] | None = None, warn: Callable[[str], Any] = print) -> str | None:
    """The API key to require: ``key``, else the contents of ``key_file`` (``read_secret_file``), else
    $LOCALRL_API_KEY, else None."""
    if key is not None and key_file is not None:
        raise UserError("serve: give --api-key or --api-key-file, not both")
    where = "--api-key"
    if key_file is not None:
        where = f"--api-key-file {key_file}"
        key = read_secret_file(key_file, f"serve {where}", warn).strip()
    elif key is None:
        key, where = (os.environ if environ is None else environ).get(API_KEY_ENV) or None, API_KEY_ENV
        if key is None:
            return None
    key = key.strip()
    if not key or not key.isascii() or not key.isprintable() or " " in key:
        raise UserError(f"serve {where}: the key must be one word of printable ASCII (got {len(key)} characters)")
    return key


def _cors_origin(origin: str) -> str:
    """A --cors-origin as browsers send it in an Origin header, or a UserError."""
    parts = urllib.parse.urlsplit(origin.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or parts.fragment \
            or "@" in parts.netloc:
        raise UserError(f"serve --cors-origin {origin!r}: must be one origin, scheme://host[:port], such as "
                        "http://localhost:3000")
    return f"{parts.scheme}://{parts.netloc.lower()}"


def serve(path: str | Path, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          n_ctx: int = 0, log: Callable[[str], Any] = print, *, max_body_bytes: int = MAX_BODY_BYTES,
          cors_origins: tuple[str, ...] = (), allowed_hosts: tuple[str, ...] = (), insecure: bool = False,
          limits: RequestLimits = RequestLimits()) -> None:
    """Run the server until interrupted; ``n_ctx`` 0 is the context the model was trained for.

    A ``host`` other than loopback needs an ``api_key``, or ``insecure``. The Gate's docstring says what a request
    must pass: ``max_body_bytes``, ``cors_origins`` and ``allowed_hosts`` (Host header names beyond the bound address),
    and ``limits`` bounds what llama.cpp and the HTTP parser may be made to read (``localrl.serving.limits``).
    """
    if not 1 <= port <= 65535:
        raise UserError(f"serve: --port must be 1-65535 (got {port})")
    if n_ctx < 0:
        raise UserError(f"serve: --n-ctx must be 0 (the model's training context) or more (got {n_ctx})")
    if max_body_bytes < 1:
        raise UserError(f"serve: --max-body-bytes must be at least 1 (got {max_body_bytes})")
    try:
        limits.check()
    except ValueError as e:
        raise UserError(f"serve: {e}") from None
    cors_origins = tuple(_cors_origin(o) for o in cors_origins)
    for name in allowed_hosts:
        if not name.strip() or any(c in name for c in "/@ \t*?[]") or not _host_name(name):
            raise UserError(f"serve --allowed-host {name!r}: must be a host name such as myhost.lan (no scheme, path "
                            "or wildcard: name each host)")
    if not is_loopback(host):  # checked before anything binds
        if not api_key and not insecure:
            raise UserError(f"serve: --host {host} is reachable from other machines: require a key "
                            f"(--api-key-file PATH or {API_KEY_ENV}), or serve it to anyone with --insecure")
        if not api_key:
            log(f"warning: serving on {host} with no API key (--insecure): anyone who can reach it can use the model")
    info = read_gguf_info(path)
    p, trained = info.path, info.context_length
    # beyond the training context a small model answers garbage with status 200; within it, llama.cpp's own
    # check turns a longer prompt into a 400
    n_ctx = n_ctx or trained or DEFAULT_N_CTX
    server_app = require_llama_cpp_server("serve")
    import uvicorn
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from localrl.serving.bounded_http import bounded_protocol

    sock = _bound_socket(host, port)  # before the model loads, and kept, so the port cannot be taken meanwhile
    try:
        server = ServerSettings(host=host, port=port, api_key=api_key or None)
        model = ModelSettings(model=str(p), model_alias=p.stem, n_ctx=n_ctx, verbose=False)
        try:
            app = server_app.create_app(server_settings=server, model_settings=[model])
        except ValueError as e:  # llama-cpp-python's "Failed to load model" / "Failed to create llama_context"
            raise UserError(f"serve: llama.cpp cannot load {p} with a {n_ctx}-token context ({e})") from None
        _drop_cors(app)
        # the loaded model, for the checks that need its vocabulary (None if llama-cpp-python moves it)
        proxy = getattr(server_app, "_llama_proxy", None)
        llama = proxy() if proxy is not None else None
        template = (llama.metadata.get("tokenizer.chat_template", "") if llama is not None else "") or ""
        app = ToolMessages(ValidateRequests(ToolCalls(app), llama, p.stem, n_ctx, limits), template)
        app = GuardErrors(Gate(app, *served_hosts(host, allowed_hosts), api_key or None, max_body_bytes, cors_origins,
                               limits.max_headers))
        address = f"[{host}]" if ":" in host else host  # an IPv6 address is bracketed in a URL
        log(f"serving {p} as {p.stem!r} on http://{address}:{port}/v1 with a {n_ctx}-token context "
            "(OpenAI-compatible; Ctrl-C stops)")
        if trained and n_ctx > trained:
            log(f"note: --n-ctx {n_ctx} is beyond the {trained} tokens the model was trained on: "
                "replies to longer prompts may be garbage")
        try:
            config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=bounded_protocol(limits))
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled; stopping is what was asked
            pass
    finally:
        sock.close()


def _drop_cors(app) -> None:
    """Take out the CORS middleware llama-cpp-python adds, which lets every origin in, credentials allowed: any web
    page could then drive a server without a key. The Gate answers for the --cors-origin origins instead."""
    from starlette.middleware.cors import CORSMiddleware

    if getattr(app, "middleware_stack", None) is not None:  # built: too late to change (Starlette builds it lazily)
        raise RuntimeError("llama-cpp-python's app has built its middleware already: cannot take its CORS out")
    app.user_middleware = [m for m in app.user_middleware if m.cls is not CORSMiddleware]
