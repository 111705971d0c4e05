"""Grouped sampling in llama.cpp (llama-cpp-python's low-level API), for fast rollouts on a CPU.

The same contract as ``rollout.sample_groups``: each prompt is computed once, its keys and values
then copied to the other G-1 sequences of its group, and the B*G sequences decode together, one
batch per token, which is where llama.cpp beats one-sequence-at-a-time generation. The prefix all
prompts share (a system prompt, the chat template's opening) is computed once for the whole batch.
Each sequence has its own key/value stream: in llama.cpp's unified cache every token attends over
the cells of all sequences (masked), a cost that grows with the batch; 64 held-out prompts decoded
3.3x faster in separate streams. Sampling is done here in numpy (inverse
cumulative distribution, a seeded generator), so the same seed gives the same completions run to run.

A LoRA adapter in GGUF form can be attached to the running context (``set_adapter``) without
reloading the base. Log-probabilities for training are never taken from here: the trainer
recomputes them with the torch policy.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from localrl.errors import UserError
from localrl.memory import LLAMA_DRAW_ROWS, LLAMA_MAX_SEQUENCES
from localrl.quant.runtime import quiet, require_llama_cpp


@dataclass
class Samples:
    tokens: list[list[int]]  # per completion, prompt-major
    logprobs: list[list[float]]  # the sampler's log-probability of each of those tokens


class LlamaCppSampler:
    """A llama.cpp model and context sized for ``max_rows`` sequences of up to ``max_tokens`` tokens each."""

    def __init__(self, gguf_path: str | Path, max_rows: int, max_tokens: int, threads: int | None = None):
        self.lib = require_llama_cpp("the llama.cpp rollout backend")
        lib = self.lib
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        with quiet():
            self.model = lib.llama_model_load_from_file(str(gguf_path).encode(), params)
        if not self.model:
            raise UserError(f"llama.cpp cannot load {gguf_path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.max_rows = max_rows = min(max_rows, LLAMA_MAX_SEQUENCES)  # (more rows are sampled a context-full at a time)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = max_rows * max_tokens  # split evenly: max_tokens cells for each sequence's stream
        cparams.n_batch = max(max_rows * max_tokens, 512)  # every prompt in one call (run 512 tokens at a time)
        cparams.n_ubatch = 512
        cparams.n_seq_max = max_rows
        cparams.n_threads = cparams.n_threads_batch = threads or torch.get_num_threads()  # the run's (--threads)
        cparams.kv_unified = False
        cparams.no_perf = True
        # values in q8_0, keys in f16 (2026-12-07, SmolLM2-135M, 256 x 48 tokens: 1.3-1.6x the tokens a second,
        # a third less context memory, log-probabilities 0.006 from torch's float32 against 0.003; q8_0 keys
        # too cost 0.016): llama.cpp quantises the value cache under flash attention, which it then turns on,
        # for heads a whole number of q8_0 blocks wide (memory.llama_v_bytes); others keep f16 values
        self.ctx = None
        for values in (lib.GGML_TYPE_Q8_0, lib.GGML_TYPE_F16):
            cparams.type_k, cparams.type_v = lib.GGML_TYPE_F16, values
            with quiet():
                self.ctx = lib.llama_init_from_model(self.model, cparams)
            if self.ctx:
                break
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise UserError(f"llama.cpp cannot make a context of {max_rows} x {max_tokens} tokens")
        self.adapter = None

    def set_adapter(self, lora_path: str | Path | None, scale: float = 1.0) -> None:
        """Attach a LoRA adapter (GGUF) to the running context, replacing the previous one (None: none)."""
        lib = self.lib
        if self.adapter is not None:
            with quiet():
                lib.llama_set_adapters_lora(self.ctx, None, 0, None)
                lib.llama_adapter_lora_free(self.adapter)
            self.adapter = None
        if lora_path is None:
            return
        with quiet():
            adapter = lib.llama_adapter_lora_init(self.model, str(lora_path).encode())
        if not adapter:
            raise UserError(f"llama.cpp cannot load the LoRA adapter {lora_path}")
        self.adapter = adapter
        adapters = (lib.llama_adapter_lora_p_ctypes * 1)(adapter)
        scales = (ctypes.c_float * 1)(scale)
        with quiet():
            refused = lib.llama_set_adapters_lora(self.ctx, adapters, 1, scales) != 0
        if refused:
            raise RuntimeError("llama.cpp refused the LoRA adapter")

    def sample_groups(self, prompts: list[list[int]], group_size: int, max_new_tokens: int, stop_ids: list[int],
                      temperature: float = 1.0, seed: int = 0) -> Samples:
        """``group_size`` completions (token ids, a stop token included) for each prompt, prompt-major, with
        the log-probability of each token under the sampler (at ``temperature``; 0 when greedy)."""
        lib, rows = self.lib, len(prompts) * group_size
        if rows > self.max_rows:
            raise ValueError(f"{rows} sequences, but the context was made for {self.max_rows}")
        memory = lib.llama_get_memory(self.ctx)
        lib.llama_memory_clear(memory, True)
        rng = np.random.default_rng(seed)
        batch = lib.llama_batch_init(max(sum(map(len, prompts)), rows), 0, 1)
        firsts = range(0, rows, group_size)  # the sequence that computes each prompt for its group
        try:
            shared = _shared_prefix(prompts) if len(prompts) > 1 else 0
            if shared:  # computed once, copied to the first sequence of every group
                self._decode(batch, [(token, pos, 0, False) for pos, token in enumerate(prompts[0][:shared])])
                for first in firsts[1:]:
                    lib.llama_memory_seq_cp(memory, 0, first, -1, -1)
            entries, last = [], []
            for first, prompt in zip(firsts, prompts):
                entries += [(prompt[pos], pos, first, pos == len(prompt) - 1) for pos in range(shared, len(prompt))]
                last.append(len(entries) - 1)
            self._decode(batch, entries)
            for first in firsts:
                for seq in range(first + 1, first + group_size):
                    lib.llama_memory_seq_cp(memory, first, seq, -1, -1)  # applied before the next decode
            logits = np.empty((rows, self.n_vocab), dtype=np.float32)  # [rows, V], filled in place
            for first, i in zip(firsts, last):
                logits[first:first + group_size] = self._logits(i)
            positions = np.repeat([len(p) for p in prompts], group_size)
            streams = np.arange(rows)  # the sequence (llama.cpp's stream) holding each row's cache
            out: list[list[int]] = [[] for _ in range(rows)]
            logps: list[list[float]] = [[] for _ in range(rows)]
            live = np.ones(rows, dtype=bool)
            stops = set(stop_ids)
            for step in range(max_new_tokens):
                order = np.flatnonzero(live)  # the sequences still generating
                tokens, token_logps = _draw_rows(logits, order, temperature, rng)
                for r, token, logp in zip(order, tokens.tolist(), token_logps.tolist()):
                    out[r].append(token)
                    logps[r].append(logp)
                    if token in stops:
                        live[r] = False
                if not live.any() or step == max_new_tokens - 1:
                    break
                going = live[order]
                order, tokens = order[going], tokens[going]
                self._compact(memory, streams, live)
                by_stream = np.argsort(streams[order])
                order, tokens = order[by_stream], tokens[by_stream]
                self._decode(batch, [(t, int(positions[r]), int(streams[r]), True)
                                     for r, t in zip(order, tokens.tolist())])
                positions[order] += 1
                for i, r in enumerate(order):
                    logits[r] = self._logits(i)
            return Samples(out, logps)
        finally:
            lib.llama_batch_free(batch)

    def _compact(self, memory, streams: np.ndarray, live: np.ndarray) -> None:
        """Move the caches of the ``live`` rows into the lowest streams (``streams``, per row, updated), so that
        a decode's sequences are consecutive. llama.cpp splits a batch over separate streams at every gap in
        its sequence ids (``split_equal``, sequential) and computes each run of consecutive ids as a batch of
        its own (2026-12-07, SmolLM2-135M: 128 rows, every other sequence, decoded in 2.67 s against 0.36 s
        for 128 consecutive ones); the rows that stopped leave those gaps."""
        held = streams[live]
        movers = np.flatnonzero(live & (streams >= len(held)))
        free = np.setdiff1d(np.arange(len(held)), held)  # as many as the movers
        for r, to in zip(movers, free.tolist()):
            self.lib.llama_memory_seq_cp(memory, int(streams[r]), to, -1, -1)  # whole stream, at the next decode
            self.lib.llama_memory_seq_rm(memory, int(streams[r]), -1, -1)
            streams[r] = to

    def _decode(self, batch, entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode (token, position, sequence, wants logits) entries in one call."""
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, want_logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want_logits
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama.cpp could not decode the batch (context too small?)")

    def _logits(self, i: int) -> np.ndarray:
        """The logits of the batch's ``i``-th output: a view of llama.cpp's buffer, valid until the next decode."""
        pointer = self.lib.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def close(self) -> None:
        self.set_adapter(None)
        with quiet():
            if self.ctx:
                self.lib.llama_free(self.ctx)
                self.ctx = None
            if self.model:
                self.lib.llama_model_free(self.model)
                self.model = None


def _shared_prefix(prompts: list[list[int]]) -> int:
    """Tokens at the start of every prompt, leaving each at least one token of its own (for its logits)."""
    n = min(map(len, prompts)) - 1
    for i in range(max(n, 0)):
        if any(p[i] != prompts[0][i] for p in prompts):
            return i
    return max(n, 0)


def _draw_rows(logits: np.ndarray, order: np.ndarray, temperature: float, rng: np.random.Generator
               ) -> tuple[np.ndarray, np.ndarray]:
    """``_draw`` for the rows ``order`` of ``logits``, LLAMA_DRAW_ROWS rows at a time: the same draws (the uniform
    numbers come in the same order) with a few rows' temporaries instead of every row's (the planner counts
    these, memory.llama_bytes)."""
    parts = [_draw(logits[order[i:i + LLAMA_DRAW_ROWS]], temperature, rng)
             for i in range(0, len(order), LLAMA_DRAW_ROWS)]
    return np.concatenate([t for t, _ in parts]), np.concatenate([lp for _, lp in parts])


def _draw(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One token per row from softmax(logits / T), and its log-probability there; greedy (log-prob 0)
    at temperature 0. [rows, V] -> [rows], [rows]. An exact draw by the inverse of each row's cumulative
    distribution: one uniform number a row (noise over the whole vocabulary, as in Gumbel-max, costs
    more, and float32 exponential noise is exactly 0 about once in six million draws: a random token)."""
    if temperature <= 0:
        return logits.argmax(-1), np.zeros(len(logits))
    z = logits / np.float32(temperature)
    top = z.max(-1, keepdims=True)
    cdf = np.cumsum(np.exp(z - top), axis=-1, dtype=np.float64)  # [rows, V]
    mass = cdf[:, -1]
    u = rng.random(len(z)) * mass
    tokens = np.array([min(np.searchsorted(row, x, side="right"), len(row) - 1) for row, x in zip(cdf, u)])
    logps = z[np.arange(len(z)), tokens] - top[:, 0] - np.log(mass)
    return tokens, logps


class LlamaCppRollout:
    """The llama.cpp rollout backend of a training run: the base written once as an f16 GGUF, the policy's
    LoRA adapter written as a GGUF adapter and attached before every step's sampling (no merge, no reload).

    ``sample`` returns the same ``Rollout`` the torch sampler does, plus the sampler's log-probability of
    every completion token, for the importance weights that correct the gap between the f16 llama.cpp
    sampler and the torch policy being trained.
    """

    def __init__(self, base_path: str, tok, max_rows: int, max_tokens: int, log=print, model=None):
        import tempfile

        from localrl.modeling import base_weights, load_full
        from localrl.quant.gguf_writer import write_gguf

        self.dir = tempfile.TemporaryDirectory(prefix="localrl-rollout-")
        gguf = Path(self.dir.name) / "base-f16.gguf"
        log(f"writing the base as {gguf.name} for llama.cpp rollouts")
        # from the policy's own full-precision base where it has one (``model``): no second copy of the weights
        # (the base in float32 beside a bfloat16 policy), and the sampler holds the policy's values (in f16)
        weights = base_weights(model) if model is not None else None
        if weights is not None:
            self.config = model.config
            write_gguf(weights, self.config, Path(base_path), tok, gguf, "f16")
        else:
            base = load_full(base_path)
            self.config = base.config
            write_gguf(base.state_dict(), base.config, Path(base_path), tok, gguf, "f16")
            del base
        del weights
        self.sampler = LlamaCppSampler(gguf, max_rows, max_tokens)
        self.adapter = Path(self.dir.name) / "adapter.gguf"

    def sample(self, model, prompts: list[list[int]], group_size: int, max_new_tokens: int, stop_ids: list[int],
               pad_id: int, temperature: float, seed: int, lora_alpha: float):
        """(Rollout, sampler log-probs [N, R]) for the current weights of ``model`` (a PEFT model)."""
        import torch
        from peft import get_peft_model_state_dict

        from localrl.generation.rollout import Rollout, left_pad
        from localrl.quant.lora_gguf import write_lora_gguf

        write_lora_gguf(get_peft_model_state_dict(model), self.config, lora_alpha, self.adapter)
        self.sampler.set_adapter(self.adapter, 1.0)
        at_once = max(self.sampler.max_rows // group_size, 1)  # prompts whose groups the context holds at a time
        samples = Samples([], [])
        for i in range(0, len(prompts), at_once):
            part = self.sampler.sample_groups(prompts[i:i + at_once], group_size, max_new_tokens, stop_ids,
                                              temperature, seed + i // at_once)
            samples.tokens += part.tokens
            samples.logprobs += part.logprobs
        width = max(len(t) for t in samples.tokens)
        ids = torch.full((len(samples.tokens), width), pad_id, dtype=torch.long)  # [N, R] right-padded
        mask = torch.zeros_like(ids)
        logp = torch.zeros(ids.shape, dtype=torch.float32)
        for i, (tokens, lps) in enumerate(zip(samples.tokens, samples.logprobs)):
            ids[i, :len(tokens)] = torch.tensor(tokens)
            mask[i, :len(tokens)] = 1
            logp[i, :len(tokens)] = torch.tensor(lps)
        stops = set(stop_ids)
        truncated = torch.tensor([not t or t[-1] not in stops for t in samples.tokens])
        prompt_ids, prompt_mask = left_pad(prompts, pad_id)
        return Rollout(prompt_ids, prompt_mask, ids, mask, truncated, group_size), logp

    def close(self) -> None:
        self.sampler.close()
        self.dir.cleanup()
