"""The models a simulated shell (``--env world:SOURCE``) asks: what ``SOURCE`` names.

- a model in torch: a built-in name (``tiny-shell-world``), a model directory, a run directory (its adapter merged
  onto the base) or a GGUF file (read into torch). Decoding is greedy; the questions of the episodes that step
  at the same time (the environment workers') are decoded together, in one batch.
- a model behind an OpenAI-compatible endpoint (``http://127.0.0.1:11434/v1|qwen2.5:7b``: Ollama, llama.cpp's
  server, ``localrl serve``), asked for greedy chat completions by ``localrl.generation.endpoint``.
- ``sandbox``: the real shell, in the sandbox, answering in the world format: the perfect world model, the
  reference a learned one is measured against, and what ``localrl models build tiny-shell-world`` records.

``ask(tree, command)`` is the raw reply (None: none came, the request failed); replies are kept, so a question
asked again (the episodes of a group often run the same command on the same files) is answered at once.
"""

from __future__ import annotations

import queue
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import torch

from localrl.envs.world_format import Tree, answer, messages, read_tree, write_tree
from localrl.envs.tree import remove_tree
from localrl.errors import UserError

MAX_REPLY_TOKENS = 384  # a reply: the output, then every file changed in full
BATCH_WAIT_S = 0.01  # after the first question, how long to wait for the others of the same round
CACHE_LIMIT = 50_000


class WorldModel(Protocol):
    name: str

    def ask(self, tree: Tree, command: str) -> str | None: ...

    def close(self) -> None: ...


class _Cache:
    def __init__(self):
        self._replies: dict[tuple, str] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple) -> str | None:
        with self._lock:
            return self._replies.get(key)

    def put(self, key: tuple, reply: str) -> None:
        with self._lock:
            if len(self._replies) >= CACHE_LIMIT:
                self._replies.clear()
            self._replies[key] = reply


def _key(tree: Tree, command: str) -> tuple:
    return tuple(sorted(tree.items())), command


class TorchWorld:
    """A causal LM in torch, whose concurrent questions are decoded together (greedily) by one thread."""

    def __init__(self, source: str, max_tokens: int = MAX_REPLY_TOKENS, batch: int = 64):
        from localrl.generation.rollout import stop_token_ids
        from localrl.runs import load_merged

        def has_chat_template(config, tok) -> None:
            if not tok.chat_template:
                raise UserError(f"config field env: world model {source}: its tokenizer has no chat template",
                                field="env")

        self.model, self.tok, _, _ = load_merged(source, check=has_chat_template)
        self.name = str(source)
        self.stops = stop_token_ids(self.tok, self.model)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.stops[0]
        self.context = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.max_tokens, self.batch = max_tokens, batch
        self._cache = _Cache()
        self._questions: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="world-model")
        self._thread.start()

    def memory_bytes(self) -> int:
        """Its weights, and the key/value caches and last logits of a full batch at its whole context."""
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        size = next(self.model.parameters()).element_size()
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        caches = self.batch * self.context * c.num_hidden_layers * 2 * kv_heads * head_dim * size
        return weights + caches + self.batch * c.vocab_size * 4

    def ask(self, tree: Tree, command: str) -> str | None:
        key = _key(tree, command)
        if (reply := self._cache.get(key)) is not None:
            return reply
        text = self.tok.apply_chat_template(messages(tree, command), tokenize=False,
                                            add_generation_prompt=True)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) + 16 > self.context:  # no room for a reply: no reply
            return None
        answered: Future = Future()
        self._questions.put((ids, answered))
        reply = answered.result()
        self._cache.put(key, reply)
        return reply

    def _serve(self) -> None:
        while True:
            first = self._questions.get()
            if first is None:
                return
            round_ = [first]
            try:
                round_.append(self._questions.get(timeout=BATCH_WAIT_S))
                while len(round_) < self.batch:
                    round_.append(self._questions.get_nowait())
            except queue.Empty:
                pass
            if None in round_:
                round_.remove(None)
                self._questions.put(None)
            try:
                replies = self._decode([ids for ids, _ in round_])
            except Exception as e:  # noqa: BLE001 - handed to the asking thread
                for _, answered in round_:
                    answered.set_exception(e)
                continue
            for (_, answered), reply in zip(round_, replies):
                answered.set_result(reply)

    @torch.no_grad()
    def _decode(self, prompts: list[list[int]]) -> list[str]:
        from localrl.generation.rollout import sample_groups

        room = min(self.max_tokens, self.context - max(len(p) for p in prompts))
        out = sample_groups(self.model, prompts, 1, room, self.stops, self.pad, temperature=0.0)
        return [self.tok.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                for ids, mask in zip(out.completion_ids, out.completion_mask)]

    def close(self) -> None:
        """Ends the decoding thread and waits for it (a round in progress is finished first): a thread still in
        torch when the interpreter exits can abort the process ("terminate called without an active exception")."""
        self._questions.put(None)
        self._thread.join()


class EndpointWorld:
    """A model behind an OpenAI-compatible endpoint (``URL|MODEL``), asked greedily with the format explained."""

    def __init__(self, spec: str, settings, max_tokens: int = MAX_REPLY_TOKENS):
        from localrl.generation.endpoint import Endpoint

        self.endpoint = Endpoint(spec, "env", settings, role="world model")
        self.endpoint.check()
        self.name, self.max_tokens = spec, max_tokens

    def ask(self, tree: Tree, command: str) -> str | None:
        return self.endpoint.chat([messages(tree, command)], self.max_tokens)[0]

    @property
    def last_error(self) -> str:
        return self.endpoint.last_error

    def close(self) -> None:
        pass


class SandboxWorld:
    """The real shell in the sandbox, answering in the world format: each question is played in a fresh working
    directory made from its files."""

    name = "sandbox"

    def __init__(self, isolation: str | None = None, timeout: float = 5.0, output_limit: int = 1000):
        self.isolation, self.timeout, self.output_limit = isolation, timeout, output_limit
        self._cache = _Cache()

    def step(self, tree: Tree, command: str) -> tuple[str, Tree]:
        """(the observation the agent sees, the files after) of ``command`` run on ``tree``."""
        from localrl.envs.sandbox import Sandbox

        root = Path(tempfile.mkdtemp(prefix="localrl-world-"))
        try:
            write_tree(tree, root)
            sandbox = Sandbox(root, timeout=self.timeout, output_limit=self.output_limit, isolation=self.isolation,
                              private_workdir=True)
            observation = sandbox.run(command).describe(echo=False)
            return observation, read_tree(root)
        finally:
            remove_tree(root)

    def ask(self, tree: Tree, command: str) -> str | None:
        key = _key(tree, command)
        if (reply := self._cache.get(key)) is None:
            observation, after = self.step(tree, command)
            reply = answer(observation, tree, after)
            self._cache.put(key, reply)
        return reply

    def close(self) -> None:
        pass


def open_world_model(source: str, settings=None, where: str = "") -> WorldModel:
    """The world model ``source`` names (an endpoint's requests as ``settings``: an ``EndpointSettings``); a model
    that cannot be loaded is one line starting with ``where`` (default: the env field's world model)."""
    from localrl.generation.endpoint import EndpointSettings, is_endpoint

    if source == "sandbox":
        return SandboxWorld()
    if is_endpoint(source):
        return EndpointWorld(source, settings or EndpointSettings())
    try:
        return TorchWorld(source)
    except UserError as e:  # the model's own line, said of the world model (it named the policy's field)
        if str(e).startswith("config field env:"):
            raise
        said = str(e).removeprefix(f"model {source!r}: ").removeprefix(f"model {source}: ")
        raise UserError(f"{where or f'config field env: world model {source}'}: {said}",
                        field=None if where else "env") from None
