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

The middlewares, outermost first, each in its module: ``GuardErrors`` (error_guard.py), ``Gate`` (gate.py, with
where the key comes from), ``NormaliseMessages`` (messages.py: every message shape OpenAI's API takes),
``ToolMessages`` and ``ToolCalls`` (tool_rewrite.py), ``ValidateRequests``
(validation.py); what they share is asgi.py. This module checks the settings, loads the model and serves.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from localrl.errors import UserError
from localrl.quant.gguf_info import read_gguf_info
from localrl.quant.runtime import require_llama_cpp_server
from localrl.serving.error_guard import GuardErrors
from localrl.serving.gate import (API_KEY_ENV, MAX_BODY_BYTES, Gate, cors_origin, host_name, is_loopback,
                                  served_hosts)
from localrl.serving.limits import RequestLimits
from localrl.serving.messages import NormaliseMessages
from localrl.serving.tool_rewrite import ToolCalls, ToolMessages
from localrl.serving.validation import ValidateRequests

DEFAULT_N_CTX = 2048  # for a GGUF that does not say which context it was trained for


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
    cors_origins = tuple(cors_origin(o) for o in cors_origins)
    for name in allowed_hosts:
        if not name.strip() or any(c in name for c in "/@ \t*?[]") or not host_name(name):
            raise UserError(f"serve --allowed-host {name!r}: must be a host name such as myhost.lan (no scheme, path "
                            "or wildcard: name each host)")
    if not is_loopback(host) and not api_key and not insecure:  # checked before anything binds
        raise UserError(f"serve: --host {host} is reachable from other machines: require a key "
                        f"(--api-key-file PATH or {API_KEY_ENV}), or serve it to anyone with --insecure")
    info = read_gguf_info(path)
    p, trained = info.path, info.context_length
    # beyond the training context a small model answers garbage with status 200; within it, llama.cpp's own
    # check turns a longer prompt into a 400
    n_ctx = n_ctx or trained or DEFAULT_N_CTX
    _check_context_fits(info, n_ctx)
    server_app = require_llama_cpp_server("serve")
    import uvicorn
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from localrl.serving.bounded_http import bounded_protocol

    sock = _bound_socket(host, port)  # before the model loads, and kept, so the port cannot be taken meanwhile
    if not is_loopback(host) and not api_key:  # (once the address is known to be one: it is bound)
        log(f"warning: serving on {host} with no API key (--insecure): anyone who can reach it can use the model")
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
        app = ToolMessages(ValidateRequests(ToolCalls(app), n_ctx, llama, p.stem, limits), template)
        app = NormaliseMessages(app)
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


def _check_context_fits(info, n_ctx: int) -> None:
    """The weights and an ``n_ctx``-token f16 key/value cache (llama-cpp-python's) fit the memory available: else
    one line before llama.cpp tries (it failed after seconds with its own line)."""
    from localrl.memory import ModelShape, available_bytes

    try:
        cache = ModelShape.from_config(info.sizes).kv_bytes(n_ctx)
    except (KeyError, TypeError, ZeroDivisionError):  # a header without the sizes: left to llama.cpp
        return
    free = available_bytes(SimpleNamespace(type="cpu"))  # (llama.cpp's context lives in the process's memory)
    need = info.path.stat().st_size + cache
    if free is not None and need > free:
        raise UserError(f"serve: --n-ctx {n_ctx} needs about {need / 2**30:.1f} GiB (the weights and a {n_ctx}-token "
                        f"key/value cache of {cache / 2**30:.1f} GiB), more than the {free / 2**30:.1f} GiB of memory "
                        f"available; give a smaller --n-ctx (the model was trained on "
                        f"{info.context_length or 'an unknown number of'} tokens)")


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


def _drop_cors(app) -> None:
    """Take out the CORS middleware llama-cpp-python adds, which lets every origin in, credentials allowed: any web
    page could then drive a server without a key. The Gate answers for the --cors-origin origins instead."""
    from starlette.middleware.cors import CORSMiddleware

    if getattr(app, "middleware_stack", None) is not None:  # built: too late to change (Starlette builds it lazily)
        raise RuntimeError("llama-cpp-python's app has built its middleware already: cannot take its CORS out")
    app.user_middleware = [m for m in app.user_middleware if m.cls is not CORSMiddleware]
