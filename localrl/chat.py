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
            raise UserError(f"chat: the conversation no longer fits {self.name}'s context ({e})") from None
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
        from localrl.rollout import stop_token_ids
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
        if context and ids.size(1) >= context:
            raise UserError(f"chat: the conversation is {ids.size(1)} tokens, more than {self.name}'s context of "
                            f"{context}")
        past, generated, shown = None, [], ""
        for _ in range(max_tokens):
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


def terminal_chat(source: str | Path, n_ctx: int = 0, max_tokens: int = 512, system: str | None = None,
                  temperature: float = 0.2, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> None:
    """A plain streaming chat with a GGUF, a run or a model: one user line per turn; an empty
    line, EOF or /exit ends it."""
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
