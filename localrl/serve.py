"""Serve a GGUF over an OpenAI-compatible HTTP API, or chat with it in the terminal, through llama-cpp-python.

``serve`` runs llama-cpp-python's own server (FastAPI + uvicorn): ``/v1/chat/completions``
(streaming and not), ``/v1/completions``, ``/v1/models``; loopback only unless ``--host``
says otherwise; an optional API key. Chats are formatted by the chat template stored in
the GGUF, the one localrl's export writes from the tokenizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from localrl.errors import UserError


def check_gguf_file(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"model {p}: no such file")
    with p.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"model {p}: not a GGUF file")
    return p


class ValidateRequests:
    """ASGI middleware: a malformed completion request gets a 400 JSON error, not the server's generic 500.

    llama-cpp-python's route handler reports request validation failures as internal errors;
    this checks the body against the server's own request models first.
    """

    def __init__(self, app, api_key: str | None):
        from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

        self.app, self.api_key = app, api_key
        self.models = {"/v1/chat/completions": CreateChatCompletionRequest,
                       "/v1/completions": CreateCompletionRequest}

    async def __call__(self, scope, receive, send):
        model = self.models.get(scope.get("path")) if scope["type"] == "http" and scope["method"] == "POST" else None
        headers = dict(scope.get("headers") or [])
        if model is None or (self.api_key and headers.get(b"authorization") != f"Bearer {self.api_key}".encode()):
            return await self.app(scope, receive, send)  # not ours to check, or the app's 401
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        from pydantic import ValidationError

        try:
            model.model_validate_json(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ())) or "body"
            error = {"error": {"message": f"{where}: {first.get('msg')}", "type": "invalid_request_error",
                               "param": where, "code": None}}
            payload = json.dumps(error).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def serve(path: str | Path, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          n_ctx: int = 2048, log=print) -> None:
    """Run the server until interrupted."""
    p = check_gguf_file(path)
    try:
        import uvicorn
        from llama_cpp.server.app import create_app
        from llama_cpp.server.settings import ModelSettings, ServerSettings
    except ImportError:
        raise UserError("serve: llama-cpp-python's server extras are missing (pip install 'llama-cpp-python[server]')") \
            from None
    server = ServerSettings(host=host, port=port, api_key=api_key or None)
    model = ModelSettings(model=str(p), model_alias=p.stem, n_ctx=n_ctx, verbose=False)
    app = ValidateRequests(create_app(server_settings=server, model_settings=[model]), api_key)
    log(f"serving {p} as {p.stem!r} on http://{host}:{port}/v1 (OpenAI-compatible; Ctrl-C stops)")
    uvicorn.run(app, host=host, port=port, log_level="warning")


def chat(source: str | Path, n_ctx: int = 2048, max_tokens: int = 512, system: str | None = None,
         temperature: float = 0.2, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> None:
    """A plain streaming chat with a GGUF, a run or a model: one user line per turn; an empty
    line, EOF or /exit ends it."""
    from localrl.chat import open_chat_model

    model = open_chat_model(source, n_ctx)
    messages = [{"role": "system", "content": system}] if system else []
    interactive = stdin.isatty()
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line or line.strip() in ("", "/exit"):
            break
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = []
        for delta in model.stream(messages, max_tokens=max_tokens, temperature=temperature):
            reply.append(delta)
            stdout.write(delta)
            stdout.flush()
        stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    model.close()
