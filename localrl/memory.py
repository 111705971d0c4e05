"""Memory planner: predict a GRPO step's peak memory from config.json alone, and fit it to a budget.

The prediction counts bytes the way the training step holds them (prompt_cache.py):

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

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        return cls(hidden=get("hidden_size"), layers=get("num_hidden_layers"), heads=heads,
                   kv_heads=get("num_key_value_heads") or heads,
                   head_dim=get("head_dim") or get("hidden_size") // heads,
                   intermediate=get("intermediate_size"), vocab=get("vocab_size"),
                   tied=bool(get("tie_word_embeddings", False)))

    @property
    def linear_params_per_layer(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return 2 * q + kv + mlp  # q and o have the same size

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
                 + (f" of a {gib(self.budget_bytes)} budget" if self.budget_bytes else "")
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
    """The preferred micro-batch / logits chunk / checkpointing whose predicted peak fits the budget."""
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


class MemoryBudget:
    """A run's budget: checked once for the longest prompt up front, then planned per step."""

    def __init__(self, shape: ModelShape, cfg, dtype_bytes: int, in_4bit: bool):
        self.shape, self.cfg, self.dtype_bytes, self.in_4bit = shape, cfg, dtype_bytes, in_4bit
        self.bytes = parse_bytes(cfg.memory_budget)
        self._checkpointing = False

    @classmethod
    def for_run(cls, cfg, shape: ModelShape, longest_prompt: int, device, in_4bit: bool) -> "MemoryBudget":
        """Check the budget against the longest prompt (from the tokenizer alone), before any weights load."""
        budget = cls(shape, cfg, _dtype_bytes(device), in_4bit)
        plan = budget.plan(longest_prompt, cfg.max_new_tokens)
        if not plan.fits:
            raise UserError(f"config field memory_budget: {cfg.memory_budget} cannot hold a step with "
                            f"{cfg.prompts_per_step} prompts of up to {longest_prompt} tokens x {cfg.group_size} "
                            f"completions of {cfg.max_new_tokens} tokens; the smallest plan needs "
                            f"{plan.peak_bytes / GIB:.2f} GiB", field="memory_budget")
        return budget

    def plan(self, prompt_len: int, completion_len: int) -> Plan:
        c = self.cfg
        return plan_step(self.shape, c.prompts_per_step, c.group_size, prompt_len, completion_len, self.bytes,
                         c.lora_rank, self.in_4bit, self.dtype_bytes)

    def enable_checkpointing(self, model) -> None:
        if not self._checkpointing:
            from localrl.prompt_cache import enable_checkpointing

            enable_checkpointing(model)
            self._checkpointing = True


def _dtype_bytes(device) -> int:
    return 2 if device.type == "cuda" else 4  # bf16 on a GPU, fp32 on a CPU


def available_bytes(device) -> int | None:
    """Memory a step can still take: free GPU memory, or the kernel's MemAvailable on the CPU."""
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


def rollout_bytes(shape: ModelShape, rows: int, prompt_len: int, completion_len: int, dtype_bytes: int) -> int:
    """Sampling's peak: every row's key/value cache at full length plus float32 logits and probabilities."""
    kv = 2 * shape.kv_heads * shape.head_dim * shape.layers * dtype_bytes * rows * (prompt_len + completion_len)
    return int(kv + 3 * rows * shape.vocab * 4)


def step_need(cfg, shape: ModelShape, prompt_len: int, device, in_4bit: bool,
              plan: Plan | None = None) -> tuple[int, str]:
    """(predicted peak bytes of a step, which part decides it): without a memory budget the step runs as
    configured (``micro_batch_size``, 1024-token logits chunks), with one as ``plan``; either way
    sampling must hold every row's cache."""
    rows, b = cfg.prompts_per_step * cfg.group_size, _dtype_bytes(device)
    if plan is None:
        mb = min(cfg.micro_batch_size or rows, rows)
        train = sum(predict_peak(shape, cfg.prompts_per_step, cfg.group_size, prompt_len, cfg.max_new_tokens, mb,
                                 CHUNK_CHOICES[0], False, cfg.lora_rank, in_4bit, b).values())
    else:
        train = plan.peak_bytes
    sample = rollout_bytes(shape, rows, prompt_len, cfg.max_new_tokens, b)
    return (sample, "sampling") if sample >= train else (train, "the training step")


def choose_4bit(cfg, shape: ModelShape, prompt_len: int, device) -> tuple[bool, str]:
    """Whether the base loads in 4-bit NF4, and why in words. ``quantize = "auto"`` decides here: NF4 on a
    GPU (QLoRA); on a CPU full precision, since bitsandbytes dequantises every 4-bit weight at every
    decode step there (1.2-1.8x slower sampling in `localrl bench rollout` on a quiet 2-core machine, 11.7x
    on a loaded one), unless only NF4 fits the budget or free memory."""
    if cfg.quantize != "auto":
        return cfg.quantize == "nf4", f"quantize = {cfg.quantize}"
    if device.type == "cuda":
        return True, "4-bit NF4 base (QLoRA): a GPU, where it saves memory for little speed"
    if cfg.memory_budget:
        budget = parse_bytes(cfg.memory_budget)
        full = plan_step(shape, cfg.prompts_per_step, cfg.group_size, prompt_len, cfg.max_new_tokens, budget,
                         cfg.lora_rank, False, _dtype_bytes(device))
        if not full.fits:
            return True, (f"4-bit NF4 base: a CPU, but only a 4-bit base fits the {cfg.memory_budget} budget "
                          f"(full precision needs {full.peak_bytes / GIB:.2f} GiB)")
    free = available_bytes(device)
    need, _ = step_need(cfg, shape, prompt_len, device, False)
    if free is not None and need > free and step_need(cfg, shape, prompt_len, device, True)[0] <= free:
        return True, (f"4-bit NF4 base: a CPU, but full precision needs {need / GIB:.1f} GiB and "
                      f"{free / GIB:.1f} GiB is free")
    return False, "full-precision base: a CPU, where 4-bit weights are dequantised at every decode step (slower)"


def check_step_fits(cfg, shape: ModelShape, prompt_len: int, device, in_4bit: bool, plan: Plan | None = None) -> None:
    """Refuse, before the run starts, a step predicted to need more memory than the machine has free."""
    free = available_bytes(device)
    if free is None:
        return
    need, what = step_need(cfg, shape, prompt_len, device, in_4bit, plan)
    if need > free:
        raise UserError(f"config: {cfg.prompts_per_step} prompts x group_size {cfg.group_size} with prompts of "
                        f"{prompt_len} tokens needs about {need / GIB:.1f} GiB for {what}, more than the "
                        f"{free / GIB:.1f} GiB free; lower group_size or prompts_per_step"
                        + ("" if cfg.memory_budget else ", or set memory_budget"), field="group_size")


def peak_memory_mb(device) -> float:
    """Peak allocated GPU memory on a CUDA ``device``, or on a CPU the process's peak resident set (what a
    watcher can act on)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
