"""Chat models behind one small interface: a GGUF through llama-cpp-python, or a run directory
(its adapter merged onto the full-precision base) or a model directory through torch.

``stream(messages)`` yields the reply's text piece by piece and stops early when ``cancel``
is set; ``localrl chat`` (``terminal_chat``) and the terminal UI's Chat and Agent screens use it.
"""

from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path
from typing import Iterator, Protocol, TextIO

import torch

from localrl.errors import UserError
from localrl.visible import visible

MIN_REPLY_TOKENS = 16  # a conversation fits a context only if this much room is left for the reply


class ContextFull(UserError):
    """The conversation does not fit the model's context (``context`` tokens)."""

    def __init__(self, message: str, context: int | None = None):
        super().__init__(message)
        self.context = context


class ChatModel(Protocol):
    name: str

    def stream(self, messages: list[dict], max_tokens: int = 512, temperature: float = 0.0,
               cancel: threading.Event | None = None) -> Iterator[str]: ...

    def close(self) -> None: ...


class GGUFChat:
    """A GGUF through llama-cpp-python; ``n_ctx`` 0 means the context the model was trained with."""

    def __init__(self, path: str | Path, n_ctx: int = 0):
        from localrl.quant.gguf_info import read_gguf_info
        from localrl.quant.runtime import require_llama_cpp

        info = read_gguf_info(path)
        Llama = require_llama_cpp(f"chatting with {info.path.name}").Llama
        self.path, self.name = info.path, info.path.name
        self.llm = Llama(model_path=str(self.path), n_ctx=n_ctx or info.context_length or 2048, verbose=False)

    def stream(self, messages, max_tokens=512, temperature=0.0, cancel=None):
        chunks = self.llm.create_chat_completion(messages=messages, max_tokens=max_tokens,
                                                 temperature=temperature, stream=True)
        try:
            first = next(chunks)
        except StopIteration:
            return
        except ValueError as e:  # llama-cpp-python: "Requested tokens (N) exceed context window of M"
            raise ContextFull(f"chat: the conversation no longer fits {self.name}'s context ({e})",
                              self.llm.n_ctx()) from None
        for chunk in itertools.chain([first], chunks):
            if cancel is not None and cancel.is_set():
                chunks.close()
                return
            delta = chunk["choices"][0]["delta"].get("content")
            if delta:
                yield delta

    def close(self):
        self.llm.close()


class TorchChat:
    """A causal LM in torch, decoding one token at a time with its KV cache."""

    def __init__(self, source: str | Path):
        from localrl.generation.rollout import stop_token_ids
        from localrl.runs import load_merged

        def has_chat_template(config, tok) -> None:  # checked before any weights load
            if not tok.chat_template:
                raise UserError(f"model {source}: its tokenizer has no chat template")

        self.model, self.tok, _, self.what = load_merged(source, check=has_chat_template)
        self.name = Path(source).name or str(source)
        self.stops = set(stop_token_ids(self.tok, self.model))

    @torch.no_grad()
    def stream(self, messages, max_tokens=512, temperature=0.0, cancel=None):
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([self.tok(text, add_special_tokens=False)["input_ids"]])
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context and ids.size(1) + MIN_REPLY_TOKENS > context:
            raise ContextFull(f"chat: the conversation is {ids.size(1)} tokens, too many for {self.name}'s context "
                              f"of {context}", context)
        past, generated, shown = None, [], ""
        for _ in range(min(max_tokens, context - ids.size(1)) if context else max_tokens):
            if cancel is not None and cancel.is_set():
                return
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
            if temperature > 0:
                nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1))
            else:
                nxt = int(logits.argmax())
            if nxt in self.stops:
                return
            generated.append(nxt)
            ids = torch.tensor([[nxt]])
            full = self.tok.decode(generated, skip_special_tokens=True)
            if full.endswith("\ufffd"):  # half a UTF-8 character: wait for the rest
                continue
            yield full[len(shown):]
            shown = full

    def close(self):
        pass


def open_chat_model(source: str | Path, n_ctx: int = 0) -> ChatModel:
    """A GGUF file, a run directory or a model directory / built-in name, ready to chat."""
    if str(source).endswith(".gguf"):
        return GGUFChat(source, n_ctx)
    return TorchChat(source)


def stream_fitted(model: ChatModel, messages: list[dict], on_drop=None, **kwargs) -> Iterator[str]:
    """``model.stream(messages, **kwargs)``; while the conversation does not fit the model's context, its
    oldest exchange (after any system message) is dropped from ``messages`` and ``on_drop(context)`` called
    (the last message is never dropped: alone too long, it is ContextFull). Both models raise ContextFull
    before their first piece of text, so nothing is shown twice."""
    while True:
        try:
            yield from model.stream(messages, **kwargs)
            return
        except ContextFull as e:
            first = 1 if messages and messages[0]["role"] == "system" else 0
            if len(messages) - first <= 1:
                raise
            del messages[first:first + 2 if len(messages) - first > 2 else first + 1]  # a user turn, its reply
            if on_drop is not None:
                on_drop(e.context)


class EndsWhenFull:
    """A chat model whose conversation, once past its context, ends with an empty reply instead of raising
    ContextFull: for measured episodes (``localrl.benchmarks.approvals``), where running out of context is the
    episode's failure, not the whole run's end, and dropping old turns (``stream_fitted``, for chats) would change
    the task the agent was given."""

    def __init__(self, model: ChatModel):
        self.model, self.name = model, model.name

    def stream(self, messages: list[dict], **kwargs) -> Iterator[str]:
        try:
            yield from self.model.stream(messages, **kwargs)
        except ContextFull:
            return

    def close(self) -> None:
        self.model.close()


def terminal_chat(source: str | Path, n_ctx: int = 0, max_tokens: int = 512, system: str | None = None,
                  temperature: float = 0.2, stdin: TextIO | None = None, stdout: TextIO | None = None,
                  stderr: TextIO | None = None) -> None:
    """A plain streaming chat with a GGUF, a run or a model: one user line per turn; an empty
    line, EOF or /exit ends it. When the conversation outgrows the model's context its oldest turns are
    dropped, said once on ``stderr`` (where the banner goes too: ``stdout`` holds only the replies).
    The streams default to the process's at the time of the call."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    model = open_chat_model(source, n_ctx)
    messages = [{"role": "system", "content": system}] if system else []
    interactive = stdin.isatty()
    stderr.write(f"chatting with {model.name} (temperature {temperature:g}, up to {max_tokens} tokens a reply); "
                 f"an empty line, /exit or Ctrl-D ends\n")
    dropped = []

    def say_once(context: int | None) -> None:
        if not dropped:
            stderr.write(f"[the conversation outgrew {model.name}'s context"
                         + (f" of {context} tokens" if context else "") + ": its oldest turns are dropped from now on]\n")
        dropped.append(context)
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line or line.strip() in ("", "/exit"):
            break
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = []
        for delta in stream_fitted(model, messages, say_once, max_tokens=max_tokens, temperature=temperature):
            reply.append(delta)
            stdout.write(visible(delta))
            stdout.flush()
        stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    model.close()
