"""What the server's ASGI middlewares share: the routes they look at, an OpenAI-style error body and how it is
sent, a request's headers, and its body read once and handed on (``replayer``)."""

from __future__ import annotations

import json

CHAT = "/v1/chat/completions"
COMPLETIONS = ("/v1/completions", "/v1/engines/copilot-codex/completions")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> dict:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [*(headers or []), (b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


async def read_body(receive, limit: int | None = None) -> bytes | None:
    """A request's whole body (a middleware that reads it hands it on with ``replayer``), or None as soon as it
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


def json_object(body: bytes) -> dict | None:
    """A request body as the JSON object it holds; None for one that is not JSON or not an object (the request
    models refuse it later, in their own words)."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    return request if isinstance(request, dict) else None


def replayer(body: bytes, receive):
    """A ``receive`` for the app that gives ``body`` first, then whatever the client sends next."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def header(scope, name: bytes) -> str | None:
    """A request header's value (the first, if it is sent twice), or None."""
    value = next((v for k, v in scope.get("headers") or [] if k.lower() == name), None)
    return None if value is None else value.decode("latin-1")
