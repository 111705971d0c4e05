"""Memory planner: predict a GRPO step's peak memory from config.json alone, and fit it to a budget.

The prediction counts bytes the way the training step holds them (shared_prompt.py):

    static      weights (4-bit linears at ~0.53 byte/param, the rest in the compute dtype)
                + LoRA parameters, gradients and two AdamW moments (fp32)
    prompt      saved activations of the prompt pass for all B prompts, their key/value
                tensors, and the gradients those accumulate (held until the step ends)
    completion  saved activations of one micro-batch of completions, including the copy of
                the prompt keys/values that attention saves once per packed sequence
    logits      one chunk of [tokens, vocab] float32 logits, alive in forward and backward

Saved activations per token and layer follow a Llama-family decoder with LoRA on every
linear layer: the residual stream and both norm outputs (4d), queries, attention output and
o_proj input (3 * n_heads * head_dim), the MLP's gate, activation, up and product (4 * I),
the LoRA bottlenecks (7 r), and attention's log-sum-exp. Keys and values are saved after
grouped-query expansion (attention runs with a mask, which rules out the GQA fast path);
completions are packed per prompt, so a prompt's keys/values are saved once per packed
sequence, not once per completion. 4-bit base layers save nothing: their backward
re-dequantizes the weight.

With activation checkpointing, a layer keeps only its input, and one layer's activations
are rebuilt at a time during backward.

The planner picks, in order of preference, no checkpointing over checkpointing, the
largest completion micro-batch, then the largest logits chunk, whose predicted peak fits.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from localrl.errors import UserError

GIB = 2**30
CHUNK_CHOICES = (1024, 512, 256, 128)  # larger chunks buy no speed, only memory


def parse_bytes(text: str, field: str = "memory_budget", what: str | None = None) -> int:
    """'10GB', '12GiB', '512MB', '2e9' -> bytes (GB and GiB both mean 2**30 here, as on GPU spec sheets).
    Errors name ``what`` (default: the config field)."""
    what = what or f"config field {field}"
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b?)?\s*", text.lower())
    if not m:
        raise UserError(f"{what}: cannot read {text!r} as a size (for example 10GB or 512MB)", field=field)
    unit = (m.group(2) or "b").rstrip("b").rstrip("i")
    value = float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit]
    if value <= 0:
        raise UserError(f"{what}: must be positive (got {text!r})", field=field)
    if value > 2**60:  # also catches 1e999, which reads as infinity
        raise UserError(f"{what}: {text!r} is more memory than any machine has", field=field)
    return int(value)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    context: int | None = None  # the longest sequence it was trained for (max_position_embeddings), where known

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        return cls(hidden=get("hidden_size"), layers=get("num_hidden_layers"), heads=heads,
                   kv_heads=get("num_key_value_heads") or heads,
                   head_dim=get("head_dim") or get("hidden_size") // heads,
                   intermediate=get("intermediate_size"), vocab=get("vocab_size"),
                   tied=bool(get("tie_word_embeddings", False)), context=get("max_position_embeddings"))

    @property
    def linear_params_per_layer(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return 2 * q + kv + mlp  # q and o have the same size

    @property
    def matrix_params(self) -> int:
        """Every layer's linear weights and the embedding (and the output head, when not tied); norms left out."""
        return self.linear_params_per_layer * self.layers + self.vocab * self.hidden * (1 if self.tied else 2)

    def kv_bytes(self, tokens: int, dtype_bytes: int = 2) -> int:
        """A key/value cache of ``tokens`` cells over every layer (f16 by default, as llama.cpp's)."""
        return 2 * self.kv_heads * self.head_dim * dtype_bytes * self.layers * tokens

    def lora_params(self, rank: int) -> int:
        d, qd, kvd, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        per_layer = rank * ((d + qd) + 2 * (d + kvd) + (qd + d) + 2 * (d + i) + (i + d))
        return per_layer * self.layers


@dataclass
class Plan:
    micro_batch: int
    logits_chunk: int
    checkpointing: bool
    peak_bytes: int
    parts: dict
    budget_bytes: int | None
    fits: bool

    def describe(self) -> str:
        gib = lambda b: f"{b / GIB:.2f} GiB"
        lines = [f"plan: micro_batch={self.micro_batch} completions, logits_chunk={self.logits_chunk} tokens, "
                 f"checkpointing={'on' if self.checkpointing else 'off'}",
                 f"predicted peak: {gib(self.peak_bytes)}"
                 + (f" of the {gib(self.budget_bytes)} a budget leaves the step" if self.budget_bytes else "")
                 + ("" if self.fits else "  -- DOES NOT FIT")]
        lines += [f"  {k:<11} {gib(v)}" for k, v in self.parts.items()]
        return "\n".join(lines)


def predict_peak(shape: ModelShape, prompts: int, group: int, prompt_len: int, completion_len: int,
                 micro_batch: int, logits_chunk: int, checkpointing: bool, lora_rank: int = 16,
                 load_in_4bit: bool = True, dtype_bytes: int = 4) -> dict:
    """Predicted bytes of each part of a prompt-cache GRPO step; 'peak' is their sum."""
    s, b = shape, dtype_bytes
    q, kv_full, kv = s.heads * s.head_dim, 2 * s.heads * s.head_dim, 2 * s.kv_heads * s.head_dim
    lin = s.linear_params_per_layer * s.layers
    embed = s.vocab * s.hidden * (1 if s.tied else 2)
    weights = (lin * (0.5 + 2 / 64) if load_in_4bit else lin * b) + embed * b
    static = weights + 16 * s.lora_params(lora_rank)

    per_token = b * (4 * s.hidden + 3 * q + 4 * s.intermediate + 7 * lora_rank) + 4 * s.heads
    if b < 4:  # peft casts each adapted layer's input to its float32 adapter and keeps the copy for backward
        per_token += 4 * (5 * s.hidden + q + s.intermediate)  # q, k, v, gate, up read the hidden state
    prompt_tokens = prompts * prompt_len
    rows_tokens = micro_batch * completion_len
    # A micro-batch packs its completions per prompt: each packed sequence attends over its
    # prompt's keys/values once, with a boolean [q, P + q] mask (q = its completion tokens).
    entries = min(prompts, -(-micro_batch // group) + (micro_batch % group != 0))
    q_len = min(micro_batch, group) * completion_len
    kv_seq = entries * (prompt_len + q_len)
    mask = entries * q_len * (prompt_len + q_len) * 5  # bool, plus the float copy attention makes
    if checkpointing:  # keep each layer's input; rebuild one layer at a time in backward
        prompt_act = prompt_tokens * (s.layers * b * s.hidden + per_token + b * kv_full)
        completion_act = rows_tokens * (s.layers * b * s.hidden + per_token) + kv_seq * b * kv_full + mask
    else:
        prompt_act = prompt_tokens * s.layers * (per_token + b * kv_full)
        completion_act = rows_tokens * s.layers * per_token + kv_seq * s.layers * b * kv_full + mask
    prompt_kv = 2 * prompt_tokens * s.layers * b * kv  # the recorded keys/values and their gradients
    # float32 [tokens, vocab] buffers alive at once in backward: the logits, their upcast, the softmax, its
    # gradient and the logits' gradient (measured: 5, on a 150k-vocabulary model where they are the whole step)
    logits = 5 * min(logits_chunk, rows_tokens) * s.vocab * 4
    parts = {"weights": weights, "optimizer": static - weights, "prompt": prompt_act + prompt_kv,
             "completion": completion_act, "logits": logits}
    return {k: int(v) for k, v in parts.items()}


def plan_step(shape: ModelShape, prompts: int, group: int, prompt_len: int, completion_len: int,
              budget_bytes: int | None, lora_rank: int = 16, load_in_4bit: bool = True,
              dtype_bytes: int = 4) -> Plan:
    """The preferred micro-batch / logits chunk / checkpointing whose predicted peak fits the budget: without
    checkpointing, then with it; but a micro-batch that splits a prompt's group into passes of fewer than
    SPLIT_TOKENS completion tokens comes after every checkpointed plan (such small passes cost more than
    recomputing each layer: `localrl bench memory`, 2026-12-07, a 4-bit qwen2.5-0.5b update one 32-token
    completion at a time 44.6 s against 24.1-28.3 s checkpointed at 16; docs/memory.md)."""
    rows = prompts * group
    candidates = []
    for checkpointing in (False, True):
        mb = rows
        while mb >= 1:
            for chunk in CHUNK_CHOICES:
                parts = predict_peak(shape, prompts, group, prompt_len, completion_len, mb, chunk, checkpointing,
                                     lora_rank, load_in_4bit, dtype_bytes)
                candidates.append((mb, chunk, checkpointing, parts))
            mb = mb // 2 if mb > 1 else 0
    split = lambda c: not c[2] and c[0] < min(group, rows) and c[0] * completion_len < SPLIT_TOKENS
    candidates.sort(key=split)  # (stable: the order above within each kind)
    for mb, chunk, ckpt, parts in candidates:
        peak = sum(parts.values())
        if budget_bytes is None or peak <= budget_bytes:
            return Plan(mb, chunk, ckpt, peak, parts, budget_bytes, True)
    mb, chunk, ckpt, parts = min(candidates, key=lambda c: sum(c[3].values()))
    return Plan(mb, chunk, ckpt, sum(parts.values()), parts, budget_bytes, False)


def read_shape(model: str) -> ModelShape:
    """The shape of a model from its config.json (a directory, a config.json path, or a built-in name)."""
    from localrl.modeling import resolve_model
    from localrl.quant.gguf_import import gguf_path, is_gguf_source
    from localrl.quant.gguf_info import read_gguf_info

    if is_gguf_source(model):  # the header has the sizes: no conversion needed to plan
        try:
            return ModelShape.from_config(read_gguf_info(gguf_path(model)).sizes)
        except (TypeError, KeyError):
            raise UserError(f"model {model!r}: the GGUF header lacks the sizes a planner needs") from None
    p = Path(model)
    path = p if p.is_file() else Path(resolve_model(model)) / "config.json"
    if not path.is_file():
        raise UserError(f"model {model!r}: no config.json to plan from (give a local directory or config.json)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"model {model!r}: config.json is not valid JSON ({e.msg})") from None
    config = config.get("text_config", config)
    try:
        return ModelShape.from_config(config)
    except (TypeError, KeyError):
        raise UserError(f"model {model!r}: config.json lacks the sizes a planner needs") from None


# Resident memory of a process with torch, transformers and peft imported, before any weight loads
# (measured: 0.40 GiB on the CPU, 0.42 with the built-in model loaded); on a GPU the budget is of
# allocations, where it is no part.
RUNTIME_BYTES = int(0.45 * GIB)
FREE_MARGIN = 0.10  # without memory_budget, the budget is the memory free at start less this share
# Every phase is planned to fit the budget with this much to spare on what it adds to the memory held all run
# (MemoryBudget.with_margin): `localrl bench memory` measured peaks from 6% under to 23% over the predictions
# on the CPU, the most where the C heap keeps freed small activations (micro-batches of a few completions;
# heap.py) (docs/memory.md)
PLAN_MARGIN = 0.25
# a micro-batch that splits a prompt's group without checkpointing must keep this many completion tokens a pass
# (a choice between two measurements, docs/memory.md: 32 tokens a pass lost to checkpointing 1.6-1.9x)
SPLIT_TOKENS = 1024
# transformers' GGUF reading, per byte of float32 weights, besides the file it maps (docs/memory.md)
CONVERSION_FACTOR = 1.2


def runtime_bytes(device) -> int:
    return 0 if device.type == "cuda" else RUNTIME_BYTES


def static_bytes(shape: ModelShape, lora_rank: int, in_4bit: bool, dtype_bytes: int) -> int:
    """Weights, the adapter and its AdamW state: what every phase holds once the model has loaded."""
    parts = predict_peak(shape, 1, 2, 1, 1, 1, 1, False, lora_rank, in_4bit, dtype_bytes)
    return parts["weights"] + parts["optimizer"]


def frozen_bytes(shape: ModelShape, in_4bit: bool, device, compute_dtype: str = "auto") -> int:
    """A frozen model's weights (no adapter, no optimizer), as it loads on ``device`` in ``compute_dtype``."""
    return static_bytes(shape, 0, in_4bit, dtype_bytes(device, compute_dtype))


def load_bytes(shape: ModelShape, lora_rank: int, in_4bit: bool, dtype_bytes: int) -> int:
    """Loading: the model as it will train, plus one full-precision layer and the embedding being converted
    (quantising or casting goes tensor by tensor)."""
    layer = shape.linear_params_per_layer * dtype_bytes
    return static_bytes(shape, lora_rank, in_4bit, dtype_bytes) + layer + shape.vocab * shape.hidden * dtype_bytes


def conversion_bytes(shape: ModelShape, file_bytes: int) -> int:
    """Converting a GGUF file of ``file_bytes`` to a model directory (quant/gguf_import.py, once per file,
    before the run plans anything else): the libraries, the file (memory-mapped, so resident as it is read),
    and transformers' dequantised float32 tensors beside the model it fills (CONVERSION_FACTOR times the
    float32 weights)."""
    return RUNTIME_BYTES + file_bytes + int(CONVERSION_FACTOR * 4 * shape.matrix_params)


def check_conversion(cfg, model: str, device) -> None:
    """Refuse, before converting, a GGUF source whose one-time conversion the run's budget cannot hold."""
    from localrl.quant.gguf_import import converted_dir, gguf_path, is_gguf_source

    if not is_gguf_source(model) or converted_dir(model) is not None:
        return
    shape = read_shape(model)
    budget = MemoryBudget(shape, cfg, device, False)
    need = int(conversion_bytes(shape, gguf_path(model).stat().st_size) * (1 + PLAN_MARGIN))
    if budget.limited and need > budget.bytes:
        named = cfg.memory_budget or f"a {budget.bytes / GIB:.2f} GiB budget ({budget.source})"
        raise UserError(f"config field memory_budget: {named} cannot hold converting {model} to a model directory "
                        f"(once, before training; transformers dequantises every tensor): that needs a budget of "
                        f"at least {need / GIB:.2f} GiB", field="memory_budget")


def export_bytes(shape: ModelShape) -> int:
    """``localrl export``'s peak (quant/export.py): the libraries, the merged model in float32, and a 2-byte
    copy of its weights beside it, twice over: the checkpoint's pages as it loads (a bf16 or f16 file is
    mapped while it is cast), then llama.cpp's f16 file as it validates or quantises it. (The writer spools
    each tensor to disk as it goes.) Measured at the qwen2.5-1.5b shape: 8.98 GiB loading, 9.42 GiB
    validating, against 9.08 predicted (docs/export.md)."""
    return RUNTIME_BYTES + 6 * shape.matrix_params


def check_export(shape: ModelShape, where: str) -> None:
    """Refuse, before any weight loads, an export the memory free at start (less FREE_MARGIN) cannot hold."""
    import torch

    free = available_bytes(torch.device("cpu"))
    need = int(export_bytes(shape) * (1 + PLAN_MARGIN))
    if free is not None and need > free * (1 - FREE_MARGIN):
        raise UserError(f"{where}: needs about {need / GIB:.2f} GiB of memory (the model in float32 and a 2-byte "
                        f"copy of its weights: the checkpoint as it loads, llama.cpp's f16 file as it checks it); "
                        f"{free / GIB:.2f} GiB is free")


def decode_bytes(shape: ModelShape, prompts: int, group: int, prompt_len: int, completion_len: int,
                 dtype_bytes: int) -> int:
    """Sampling's own peak (rollout.sample_groups): the prompts' prefill, then every row's key/value cache at
    full length, one layer's copy as the cache grows, and float32 logits and probabilities of every row."""
    rows = prompts * group
    kv_token = 2 * shape.kv_heads * shape.head_dim * dtype_bytes  # one layer
    cache = kv_token * shape.layers * rows * (prompt_len + completion_len)
    growing = kv_token * rows * (prompt_len + completion_len)
    prefill = prompts * prompt_len * dtype_bytes * (4 * shape.hidden + 3 * shape.intermediate)
    return int(cache + growing + max(prefill, 3 * rows * shape.vocab * 4))


LLAMA_MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: a context holds at most this many sequences
LLAMA_CELL_PAD = 256  # llama.cpp pads each sequence's own key/value stream to a multiple of this many cells
LLAMA_DRAW_ROWS = 32  # rows whose next tokens llama_rollout draws at a time (its float64 temporaries)
# bytes a llama.cpp key/value cell holds per key (or value) element: keys in f16, values in q8_0 (34 bytes a block
# of 32) where a head is a whole number of blocks wide, else f16, as llama_rollout makes its context
LLAMA_K_BYTES, LLAMA_Q8_BLOCK = 2.0, 32


def llama_v_bytes(shape: ModelShape) -> float:
    """Bytes an element of llama.cpp's value cache takes in the sampler's context (llama_rollout)."""
    return (LLAMA_Q8_BLOCK + 2) / LLAMA_Q8_BLOCK if shape.head_dim % LLAMA_Q8_BLOCK == 0 else 2.0


def llama_cells(rows: int, tokens: int) -> int:
    """Key/value cells of a llama.cpp context of ``rows`` sequences of ``tokens`` each, one stream a sequence
    (``kv_unified`` off), as llama.cpp sizes it: the total padded, then each stream padded again (160 tokens
    a sequence take 256 cells)."""
    rows = min(rows, LLAMA_MAX_SEQUENCES)
    pad = lambda n: -(-n // LLAMA_CELL_PAD) * LLAMA_CELL_PAD
    return pad(pad(rows * tokens) // rows) * rows


def llama_kv_bytes(shape: ModelShape, rows: int, tokens: int) -> int:
    """The key/value cache of a llama.cpp context of ``rows`` sequences of ``tokens`` (keys f16, values
    ``llama_v_bytes``)."""
    cell = shape.kv_heads * shape.head_dim * shape.layers * (LLAMA_K_BYTES + llama_v_bytes(shape))
    return int(cell * llama_cells(rows, tokens))


def llama_bytes(shape: ModelShape, rows: int, tokens: int) -> int:
    """llama.cpp's share of a process that samples with it (llama_rollout.py): the weights written as f16,
    the context's key/value cells for ``rows`` sequences of ``tokens`` (``llama_cells``, ``llama_kv_bytes``), and
    float32 logits: llama.cpp's output buffer and its 512-token compute buffer, the sampler's copy
    of every row's and a draw's temporaries."""
    rows = min(rows, LLAMA_MAX_SEQUENCES)
    weights = 2 * shape.matrix_params
    logits = (2 * rows + 512 + 6 * min(rows, LLAMA_DRAW_ROWS)) * shape.vocab * 4
    return int(weights + llama_kv_bytes(shape, rows, tokens) + logits)


@dataclass(frozen=True)
class DecodingPhase:
    """A phase a plug-in adds to each step (its ``preflight`` declares it): greedy replies of a model of
    ``shape`` to up to ``requests`` requests of up to ``request_len`` tokens, ``reply_len`` new tokens each,
    always decoded by torch; ``weights``: what that model adds to the memory held all run (0 when it is the
    policy). ``name`` is the phase's name in the plan; ``who`` says whose replies they are in the run's lines
    ("the judge"), ``request`` what one request is ("request")."""

    name: str
    shape: ModelShape
    weights: int
    requests: int
    request_len: int
    reply_len: int
    who: str
    request: str = "request"


class MemoryBudget:
    """A run's memory budget and the plan of every phase under it.

    The budget is ``memory_budget``, or without one the memory free at start less ``FREE_MARGIN``; it is of
    the whole process (resident memory on a CPU, allocations on a GPU): the libraries, the weights, the
    adapter and its optimizer state, anything else the process holds all run (``extra``: llama.cpp's copy of
    the weights and its context), and each phase's own peak:

        load        the model as it trains, plus the tensor being converted
        rollout     the key/value caches of the prompts sampled at once, each with its G completions
        update      the planned micro-batches (plan_step)
        evaluation  the caches of the held-out prompts decoded at once (greedy, one completion each)
        a plug-in's own decoding phase (``DecodingPhase``: training-free GRPO's judge), its caches for the
                    requests it answers at once

    The reference's log-probabilities (the adapter off) and the old policy's run without gradients through
    the update's micro-batches, so they never need more than the update; a checkpoint is the adapter's
    weights and optimizer state, already counted. What does not fit as configured is planned smaller:
    rollouts and evaluation in fewer prompts at a time, the update in smaller micro-batches, then with
    activation checkpointing; where nothing fits, the run stops before the model loads, naming the phase.
    A GGUF file's one-time conversion is checked before it starts (``check_conversion``).
    """

    def __init__(self, shape: ModelShape, cfg, device, in_4bit: bool, extra: int = 0, torch_decodes: bool = True,
                 phase: DecodingPhase | None = None):
        self.shape, self.cfg, self.in_4bit, self.extra_phase = shape, cfg, in_4bit, phase
        self.torch_decodes = torch_decodes  # False: llama.cpp samples and evaluates (its memory is in ``extra``)
        self.dtype_bytes = dtype_bytes(device, cfg.compute_dtype)
        if cfg.memory_budget:
            self.bytes, self.source = parse_bytes(cfg.memory_budget), "memory_budget"
        else:
            free = available_bytes(device)
            self.bytes = None if free is None else int(free * (1 - FREE_MARGIN))
            self.source = "" if free is None else (f"{free / GIB:.2f} GiB free at start less {FREE_MARGIN:.0%}, "
                                                     f"as memory_budget is empty")
        self.longest_prompt = 0  # tokens (for_run sets it): what the run's phases are planned for
        self.base = runtime_bytes(device) + extra + (phase.weights if phase else 0)  # held all run
        self.held = self.base + static_bytes(shape, cfg.lora_rank, in_4bit, self.dtype_bytes)  # once it has loaded

    @classmethod
    def for_run(cls, cfg, shape: ModelShape, longest_prompt: int, device, in_4bit: bool,
                extra: int = 0, torch_decodes: bool = True, phase: DecodingPhase | None = None) -> "MemoryBudget":
        """The budget, checked phase by phase against the longest prompt, before any weights load."""
        budget = cls(shape, cfg, device, in_4bit, extra, torch_decodes, phase)
        budget.longest_prompt = longest_prompt
        budget.check(longest_prompt, cfg.max_new_tokens)
        return budget

    @property
    def limited(self) -> bool:
        return self.bytes is not None

    def with_margin(self, peak: int) -> int:
        """A phase's predicted peak with ``PLAN_MARGIN`` on what it adds to the memory held all run: what the
        budget must hold. The held part (the libraries, the weights, the adapter and its optimizer, llama.cpp's
        weights and context) is sized exactly; the predictions' error is in what a phase computes."""
        return int(self.held + max(peak - self.held, 0) * (1 + PLAN_MARGIN))

    def _fits(self, peak: int) -> bool:
        return not self.limited or self.with_margin(peak) <= self.bytes

    @property
    def _eval_prompts(self) -> int:
        """Held-out prompts decoded at once as configured (0: the run evaluates nothing)."""
        return min(self.cfg.eval_batch_size, self.cfg.eval_size)

    def _decode(self, prompts: int, group: int, prompt_len: int, completion_len: int) -> int:
        """A torch decoding phase's peak (the process's), or what llama.cpp decoding adds to it: nothing."""
        if not self.torch_decodes:
            return self.held
        return self.held + decode_bytes(self.shape, prompts, group, prompt_len, completion_len, self.dtype_bytes)

    def _extra_decoding(self, requests: int) -> int:
        """The plug-in's decoding phase's peak (the process's) with ``requests`` requests at once."""
        x = self.extra_phase
        return self.held + decode_bytes(x.shape, requests, 1, x.request_len, x.reply_len, self.dtype_bytes)

    def extra_at_once(self) -> int:
        """How many of a step's requests the plug-in's decoding phase decodes at once: all, or the most whose
        caches fit."""
        n = self.extra_phase.requests
        while n > 1 and not self._fits(self._extra_decoding(n)):
            n = (n + 1) // 2
        return n

    def _needs(self, prompt_len: int, completion_len: int) -> dict[str, int]:
        """Each phase's smallest predicted peak (its smallest plan)."""
        c, s, b = self.cfg, self.shape, self.dtype_bytes
        smallest = plan_step(s, c.prompts_per_step, c.group_size, prompt_len, completion_len, 0, c.lora_rank,
                             self.in_4bit, b)
        return {"load": self.base + load_bytes(s, c.lora_rank, self.in_4bit, b),
                "rollout": self._decode(1, c.group_size, prompt_len, completion_len),
                "update": self.base + smallest.peak_bytes,
                **({"evaluation": self._decode(1, 1, prompt_len, completion_len)} if self._eval_prompts else {}),
                **({self.extra_phase.name: self._extra_decoding(1)} if self.extra_phase else {})}

    def least_budget(self, prompt_len: int, completion_len: int) -> tuple[str, int]:
        """The phase that needs most at its smallest plan, and the least budget (bytes, margin included)
        that holds it."""
        phase, need = max(self._needs(prompt_len, completion_len).items(), key=lambda kv: kv[1])
        return phase, self.with_margin(need)

    def fits(self, prompt_len: int, completion_len: int) -> bool:
        """Whether the run's smallest plan fits the budget (always, without one)."""
        return not self.limited or self.least_budget(prompt_len, completion_len)[1] <= self.bytes

    def check(self, prompt_len: int, completion_len: int) -> None:
        """Refuse, naming the phase and the smallest budget that would do, a run that cannot fit."""
        if self.fits(prompt_len, completion_len):
            return
        phase, need = self.least_budget(prompt_len, completion_len)
        c = self.cfg
        x = self.extra_phase
        what = {"load": "loading the model", "rollout": f"sampling one prompt's {c.group_size} completions",
                "update": "the update's smallest plan (one completion at a time, checkpointing on)",
                "evaluation": "evaluating one held-out prompt",
                **({x.name: f"{x.who}'s reply to one {x.request}"} if x else {})}[phase]
        named = self.cfg.memory_budget or f"a {self.bytes / GIB:.2f} GiB budget ({self.source})"
        raise UserError(f"config field memory_budget: {named} cannot hold {what} with prompts of up to "
                        f"{prompt_len} tokens and {completion_len} new tokens: that needs a budget of at least "
                        f"{need / GIB:.2f} GiB (or lower group_size, prompts_per_step or "
                        f"max_new_tokens)", field="memory_budget")

    def plan(self, prompt_len: int, completion_len: int) -> Plan:
        """The update's plan for a batch's real lengths: as configured (``micro_batch_size``, no checkpointing)
        when that fits, else the planner's preferred plan within what the budget leaves."""
        c = self.cfg
        # a plan's peak counts the weights and optimizer state (held, exact) and the step's activations (the margin)
        static = self.held - self.base
        room = static + int((self.bytes - self.held) / (1 + PLAN_MARGIN)) if self.limited else None
        rows = c.prompts_per_step * c.group_size
        if not c.memory_budget:  # the budget is the free memory: keep what was configured while it fits
            mb = min(c.micro_batch_size or rows, rows)
            parts = predict_peak(self.shape, c.prompts_per_step, c.group_size, prompt_len, completion_len, mb,
                                 CHUNK_CHOICES[0], False, c.lora_rank, self.in_4bit, self.dtype_bytes)
            peak = sum(parts.values())
            if room is None or peak <= room:  # (micro_batch_size 0 stays 0: every row at once, whatever the count)
                return Plan(c.micro_batch_size and mb, CHUNK_CHOICES[0], False, peak, parts, room, True)
        return plan_step(self.shape, c.prompts_per_step, c.group_size, prompt_len, completion_len, room,
                         c.lora_rank, self.in_4bit, self.dtype_bytes)

    def rollout_prompts(self, prompts: int, group: int, prompt_len: int, completion_len: int) -> int:
        """How many of ``prompts`` to sample at once (each with ``group`` completions): all, or the most whose
        caches fit (at least one)."""
        n = prompts
        while n > 1 and not self._fits(self._decode(n, group, prompt_len, completion_len)):
            n = (n + 1) // 2
        return n

    def _planned(self, prompt_len: int, completion_len: int) -> tuple[Plan, int, int]:
        """(the update's plan, prompts sampled at once, held-out prompts decoded at once)."""
        c = self.cfg
        return (self.plan(prompt_len, completion_len),
                self.rollout_prompts(c.prompts_per_step, c.group_size, prompt_len, completion_len),
                self.rollout_prompts(self._eval_prompts, 1, prompt_len, completion_len))

    def phases(self, prompt_len: int, completion_len: int, planned: tuple[Plan, int, int] | None = None
               ) -> dict[str, int]:
        """Each phase's predicted peak (bytes of the whole process) as planned (``planned``: _planned's)."""
        c = self.cfg
        plan, at_once, evals = planned or self._planned(prompt_len, completion_len)
        return {"load": self.base + load_bytes(self.shape, c.lora_rank, self.in_4bit, self.dtype_bytes),
                **({"evaluation": self._decode(evals, 1, prompt_len, completion_len)} if evals else {}),
                "rollout": self._decode(at_once, c.group_size, prompt_len, completion_len),
                "update": self.base + plan.peak_bytes,
                **({self.extra_phase.name: self._extra_decoding(self.extra_at_once())} if self.extra_phase else {})}

    def describe(self, prompt_len: int, completion_len: int) -> list[str]:
        """The run's first lines about memory: the budget with each phase's predicted peak, then (only when
        something was) what was planned smaller than configured, a line that starts "memory: to fit". None
        for a run without memory_budget that the free memory holds as configured."""
        if not self.limited:
            return []
        c = self.cfg
        planned = plan, at_once, evals = self._planned(prompt_len, completion_len)
        phases = self.phases(prompt_len, completion_len, planned)
        lines = [f"memory: a {self.bytes / GIB:.2f} GiB budget ({self.source}); predicted peaks: "
                 + ", ".join(f"{k} {v / GIB:.2f}" for k, v in phases.items()) + " GiB"]
        changed = []
        rows = c.prompts_per_step * c.group_size
        if (plan.micro_batch or rows) < min(c.micro_batch_size or rows, rows) or plan.checkpointing:
            changed.append(f"the update in micro-batches of {plan.micro_batch} "
                           f"completion{'s' * (plan.micro_batch > 1)}"
                           + (", activation checkpointing on" if plan.checkpointing else "")
                           + (f", logits in chunks of {plan.logits_chunk} tokens" if plan.logits_chunk < 1024 else ""))
        if at_once < c.prompts_per_step:
            changed.append(f"rollouts {at_once} prompt{'s' * (at_once > 1)} at a time (of {c.prompts_per_step})")
        if evals < self._eval_prompts:
            changed.append(f"evaluation {evals} prompt{'s' * (evals > 1)} at a time "
                           f"(eval_batch_size {c.eval_batch_size})")
        x = self.extra_phase
        if x and (n := self.extra_at_once()) < x.requests:
            changed.append(f"{x.who} {n} {x.request}{'s' * (n > 1)} at a time (of {x.requests})")
        if changed:
            lines.append("memory: to fit the budget, " + "; ".join(changed))
        return lines if changed or c.memory_budget else []  # the free memory holds the run as configured: quiet

    def nearing(self, peak_mb: float | None, share: float = 0.95) -> str | None:
        """A warning when a step's measured peak came within ``share`` of the budget (None otherwise)."""
        if not self.limited or peak_mb is None or peak_mb * 2**20 < share * self.bytes:
            return None
        return (f"peak memory {peak_mb / 1024:.2f} GiB reached {peak_mb * 2**20 / self.bytes:.0%} of the "
                f"{self.bytes / GIB:.2f} GiB budget ({self.source}); lower prompts_per_step, group_size or "
                f"max_new_tokens, or set a smaller memory_budget, before the machine runs out")



def dtype_bytes(device, compute_dtype: str = "auto") -> int:
    """Bytes per element of what the base computes in (``compute_dtype`` on ``device``, localrl/precision.py)."""
    from localrl.precision import compute_dtype as dtype_of

    return dtype_of(compute_dtype, device).itemsize


FREE_MEMORY_ENV = "LOCALRL_FREE_MEMORY"  # a size that stands in for the free memory (tests, a shared machine)


def available_bytes(device) -> int | None:
    """Memory a run can still take: free GPU memory, or the kernel's MemAvailable on the CPU (or
    ``$LOCALRL_FREE_MEMORY``, when set)."""
    if os.environ.get(FREE_MEMORY_ENV):
        return parse_bytes(os.environ[FREE_MEMORY_ENV], "memory_budget", f"${FREE_MEMORY_ENV}")
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def choose_4bit(cfg, shape: ModelShape, prompt_len: int, device, extra: int = 0,
                torch_decodes: bool = True, phase: DecodingPhase | None = None) -> tuple[bool, str]:
    """Whether the base loads in 4-bit NF4, and why in words. ``quantize = "auto"`` decides here: NF4 on a
    GPU (QLoRA); on a CPU full precision, since bitsandbytes dequantises every 4-bit weight at every
    decode step there (1.2-1.8x slower sampling in `localrl bench rollout` on a quiet 2-core machine, 11.7x
    on a loaded one), unless only NF4 fits the budget (memory_budget, or the memory free at start)."""
    if cfg.quantize != "auto":
        return cfg.quantize == "nf4", f"quantize = {cfg.quantize}"
    if device.type == "cuda":
        return True, "4-bit NF4 base (QLoRA): a GPU, where it saves memory for little speed"
    full = MemoryBudget(shape, cfg, device, False, extra, torch_decodes, phase)
    if not full.fits(prompt_len, cfg.max_new_tokens):
        need = full.least_budget(prompt_len, cfg.max_new_tokens)[1]
        return True, (f"4-bit NF4 base: a CPU, but a full-precision run needs a {need / GIB:.2f} GiB budget and "
                      f"the budget is {full.bytes / GIB:.2f} GiB ({full.source})")
    return False, "full-precision base: a CPU, where 4-bit weights are dequantised at every decode step (slower)"


def resident_bytes(field: str = "VmRSS") -> int | None:
    """The process's resident set (``VmRSS``) or its high-water mark (``VmHWM``), from /proc (None elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_resident_peak() -> None:
    """The high-water mark back to the current resident set, so the next ``resident_bytes("VmHWM")`` is the
    peak since now (a no-op where /proc/self/clear_refs cannot be written)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_mb(device) -> float:
    """Peak allocated GPU memory on a CUDA ``device``, or on a CPU the process's peak resident set (what a
    watcher can act on): its high-water mark, ``VmHWM``. Not ``getrusage``'s ``ru_maxrss``, which a process
    started by a larger one inherits from it (a run launched from a 3.8 GB test worker read 3.8 GB; VmHWM, of the
    process's own memory, 1.6 GB)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resident_bytes("VmHWM")
    if peak is not None:
        return peak / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (no /proc) Linux reports KiB
