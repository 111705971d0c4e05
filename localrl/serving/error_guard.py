"""No response carries a traceback or a file path, and no failure goes unanswered: ``GuardErrors``, the outermost
middleware, rewrites 5xx bodies and error bodies that would leak either, and answers an exception with an
OpenAI-style JSON error (a prompt over the context with a 400 ``context_length_exceeded``, streamed or not); the
details go to the server's log."""

from __future__ import annotations

import json
import logging
import re

from localrl.serving.asgi import CHAT, error_body, send_json

_CONTEXT_EXCEEDED = re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)")
# a file path: a drive or slash then two or more components, or three components joined by slashes
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.~+-]+){2,}|[\w.~+-]+(?:[\\/][\w.~+-]+){2,}")
_log = logging.getLogger("uvicorn.error")  # uvicorn's own error log, shown at the server's log level


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
                return await send_json(send, start["status"], replacement, kept)
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
                error = error_body(f"internal error: {_describe(e)}", "server_error")
                event = b"data: " + json.dumps(error).encode() + b"\n\n" if sse else b""
                return await send({"type": "http.response.body", "body": event, "more_body": False})
            return await send_json(send, status, body)
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
        return 400, error_body(message, param="messages" if path == CHAT else "prompt", code="context_length_exceeded")
    return 500, error_body(f"internal error: {_describe(e)}", "server_error")


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
        return error_body(f"internal error: {_one_line(message)}", "server_error")
    return error_body(_one_line(message))


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
