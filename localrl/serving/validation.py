"""Requests checked against the server's own request models and the loaded model before llama-cpp-python sees them
(``ValidateRequests``): each problem a 400 JSON error naming the parameter, a refused route a 404."""

from __future__ import annotations

import email.message
import json
from typing import TYPE_CHECKING

from localrl.serving.asgi import CHAT, COMPLETIONS, error_body, header, read_body, replayer, send_json
from localrl.serving.limits import RequestLimits

if TYPE_CHECKING:
    from llama_cpp import Llama

REFUSED = {"/v1/embeddings": "embeddings are not served by this model (it is loaded for text generation only)"}


class ValidateRequests:
    """ASGI middleware: a request llama-cpp-python would fail on gets a 400 JSON error, a refused route a 404.

    llama-cpp-python's route handler reports request validation failures as internal errors (with its source
    path in the message); this checks the body against the server's own request models first. With the loaded
    ``llama`` it also checks what llama.cpp would crash the process on (a token id outside the vocabulary for
    detokenize, a grammar that does not parse) or silently ignore (logit_bias for such a token id).
    """

    def __init__(self, app, n_ctx: int, llama: Llama | None = None, alias: str = "model",
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
            return await send_json(send, 404, error_body(REFUSED[path], code="not_served"))
        if scope["method"] != "POST" or path not in self.models:
            return await self.app(scope, receive, send)
        body = await read_body(receive)
        problem = self.problem(path, body, scope)
        if problem is not None:
            where, text = problem
            return await send_json(send, 400, error_body(f"{where}: {text}", param=where))
        if path == CHAT or path in COMPLETIONS:
            # llama-cpp-python names the model in a response by the request's "model", else by its file's path:
            # every response names the served alias instead, so none carries a path
            request = json.loads(body)
            request["model"] = self.alias
            body = json.dumps(request).encode()
        replay = replayer(body, receive)
        await self.app(scope, replay, send)

    @staticmethod
    def json_content_type(scope) -> bool:
        """Whether FastAPI will read the body as JSON: its Content-Type is application/json or application/*+json."""
        value = header(scope, b"content-type") or ""
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
            return where(first.get("loc", ())), str(first.get("msg"))
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


TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}  # union branches, as pydantic names them


def where(loc) -> str:
    """A pydantic error's location as the parameter a client sent: ``messages[1].content``, without the names of the
    union branches pydantic tried (``ChatCompletionRequestSystemMessage``, ``list[...]``)."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part[:1].isupper() or not part.replace("_", "").isalnum() or part in TYPE_NAMES:
            continue
        else:
            text += f".{part}" if text else part
    return text or "body"


def _token_id(key: str) -> int:
    """A logit_bias key as llama-cpp-python reads it (``int(key)``); -1 if it is not a number."""
    try:
        return int(key)
    except ValueError:
        return -1
