"""`localrl bench utilisation`: each phase of a GRPO step against the machine's own arithmetic peak.

The peak is measured, not looked up: a square matrix product of ``PEAK_N`` (2048) in float32,
and in bfloat16 where the CPU computes it natively (AVX-512 BF16 or AMX) or the step is asked to,
at the thread count the run uses, best of several. Then one real GRPO step of a model runs phase by
phase as the trainer runs it (torch sampling, the prompt-cache forward, the planned micro-batches
and checkpointing, AdamW), its base computing in the run's ``compute_dtype`` (localrl/precision.py),
each phase timed after a warm-up step and set against that dtype's peak.

Each phase's useful FLOPs are counted from the model's shape with the formulas below (matrix
products only, 2 per multiply-add; what attention masks out and what checkpointing recomputes
is not counted, so a phase that wastes work shows as a lower share of the peak):

- a token through the layers, attending ``c`` keys: ``L * (2 W + 4 h d_h c) + 2 A``, with ``W``
  a layer's linear weights (``ModelShape.linear_params_per_layer``), ``h d_h`` the query width
  and ``A`` the LoRA adapters' weights (``ModelShape.lora_params``);
- the output head on a token: ``2 d V``;
- rollout: the B prompts' prefill (the head on each prompt's last token) and B*G rows decoding
  R - 1 tokens, token t attending P + t + 1 keys;
- prompt forward: the B prompts (no head); completion forward: the B*G rows' R - 1 tokens after
  their prompt, and the head on their R tokens;
- backward: per token of both passes ``L * (2 W + 8 h d_h c) + 4 A`` (the frozen base's input
  gradients, attention's two products each way, the adapters' input and weight gradients),
  and ``2 d V`` per completion token for the head's input gradient;
- optimizer: AdamW is element-wise; its time is shown, its share of a matrix peak is not.

``tests/test_bench.py`` checks the token formula against torch's own FLOP counter
(``torch.utils.flop_counter``) on a decoding step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from localrl import precision
from localrl.errors import UserError
from localrl.memory import ModelShape

PEAK_N = 2048  # the matrix side the peak is measured at (a smoke test passes a small one)
PHASES = ("rollout", "prompt forward", "completion forward", "backward", "optimizer")


@dataclass(frozen=True)
class StepSize:
    prompts: int = 2  # B
    group: int = 8  # G
    prompt_len: int = 128  # P
    completion_len: int = 48  # R


def matmul_peak(dtype: torch.dtype, n: int = PEAK_N, repeats: int = 5) -> float:
    """FLOP/s of an n x n matrix product in ``dtype`` on this CPU at torch's thread count, best of ``repeats``."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: threads started, pages touched
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def token_flops(shape: ModelShape, rank: int, context: int) -> int:
    """Forward FLOPs of one token through every layer, attending ``context`` keys (itself included)."""
    width = shape.heads * shape.head_dim
    return shape.layers * (2 * shape.linear_params_per_layer + 4 * width * context) + 2 * shape.lora_params(rank)


def backward_token_flops(shape: ModelShape, rank: int, context: int) -> int:
    """Backward FLOPs of one token through every layer (frozen base: input gradients only; LoRA: both)."""
    width = shape.heads * shape.head_dim
    return shape.layers * (2 * shape.linear_params_per_layer + 8 * width * context) + 4 * shape.lora_params(rank)


def phase_flops(shape: ModelShape, rank: int, size: StepSize) -> dict[str, int]:
    """Useful FLOPs of each phase of one GRPO step (the module's formulas)."""
    b, p, r = size.prompts, size.prompt_len, size.completion_len
    rows = b * size.group
    head = 2 * shape.hidden * shape.vocab
    prompt_tokens = sum(token_flops(shape, rank, i + 1) for i in range(p))
    completion_tokens = sum(token_flops(shape, rank, p + t + 1) for t in range(r - 1))
    backward = (b * sum(backward_token_flops(shape, rank, i + 1) for i in range(p))
                + rows * sum(backward_token_flops(shape, rank, p + t + 1) for t in range(r - 1)) + rows * r * head)
    return {"rollout": b * (prompt_tokens + head) + rows * (completion_tokens + (r - 1) * head),
            "prompt forward": b * prompt_tokens,
            "completion forward": rows * completion_tokens + rows * r * head,
            "backward": backward,
            "optimizer": 0}


def _timed_step(model, optimizer, prompts: list[list[int]], size: StepSize, micro_batch: int) -> dict[str, float]:
    """One GRPO step of ``model`` on ``prompts``, as the trainer runs it; seconds of each phase."""
    from localrl.generation.rollout import group_generators, sample_groups
    from localrl.policy.shared_prompt import SharedPromptForward

    seconds = dict.fromkeys(PHASES, 0.0)
    model.eval()
    t0 = time.perf_counter()
    rollout = sample_groups(model, prompts, size.group, size.completion_len, [], 0, 1.0,
                            group_generators(0, range(len(prompts)), torch.device("cpu")))
    seconds["rollout"] = time.perf_counter() - t0
    if int(rollout.completion_mask.sum(1).min()) < size.completion_len:
        raise RuntimeError("bench utilisation: a completion stopped early; the FLOP count assumes R tokens each")
    model.train()
    advantages = torch.randn(rollout.completion_ids.size(0), generator=torch.Generator().manual_seed(0))
    rows = rollout.completion_ids.size(0)
    t0 = time.perf_counter()
    with SharedPromptForward(model, rollout) as fwd:
        seconds["prompt forward"] = time.perf_counter() - t0
        for start in range(0, rows, micro_batch):
            part = slice(start, min(start + micro_batch, rows))
            t0 = time.perf_counter()
            logprobs = fwd.logprobs(part)
            seconds["completion forward"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            (-(advantages[part, None] * logprobs).mean()).backward()
            seconds["backward"] += time.perf_counter() - t0
        t0 = time.perf_counter()
    seconds["backward"] += time.perf_counter() - t0  # the prompt pass's backward, on leaving the context
    t0 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds["optimizer"] = time.perf_counter() - t0
    return seconds


def bench_model(model_name: str, size: StepSize, peak: float, shapes_cache: Path | None = None,
                compute_dtype: str = "auto", log=print) -> dict:
    """One warm-up step and one timed step of ``model_name`` (a built-in model or a shape name, random
    weights), its base unquantised, computing in ``compute_dtype``, on the CPU; per phase: seconds, share of the
    step, FLOPs, FLOP/s, share of ``peak`` (that dtype's)."""
    from localrl.benchmarks.memory_phases import MemoryCase, model_dir
    from localrl.config import TrainConfig
    from localrl.memory import MemoryBudget
    from localrl.modeling import load_config, load_policy
    from localrl.policy.shared_prompt import enable_checkpointing

    path = model_dir(MemoryCase(model_name), shapes_cache or Path.home() / ".cache" / "localrl" / "shapes", log)
    cfg = TrainConfig(model=path, prompts_per_step=size.prompts, group_size=size.group,
                      max_new_tokens=size.completion_len, quantize="none", compute_dtype=compute_dtype, beta=0.0,
                      device="cpu").validate()
    device = torch.device("cpu")
    _, config = load_config(path)
    shape = ModelShape.from_config(config)
    plan = MemoryBudget.for_run(cfg, shape, size.prompt_len, device, False).plan(size.prompt_len, size.completion_len)
    torch.manual_seed(0)
    model, tok = load_policy(cfg, device, False)
    if plan.checkpointing:
        enable_checkpointing(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    vocab = min(len(tok), shape.vocab)
    ids = torch.randint(0, vocab, (size.prompts, size.prompt_len), generator=torch.Generator().manual_seed(1))
    rows = size.prompts * size.group
    micro_batch = plan.micro_batch or rows
    _timed_step(model, optimizer, ids.tolist(), size, micro_batch)  # warm-up
    seconds = _timed_step(model, optimizer, ids.tolist(), size, micro_batch)
    flops = phase_flops(shape, cfg.lora_rank, size)
    step = sum(seconds.values())
    phases = [{"phase": name, "seconds": seconds[name], "share_of_step": seconds[name] / step,
               "gflop": flops[name] / 1e9, "gflops": flops[name] / seconds[name] / 1e9 if flops[name] else None,
               "share_of_peak": flops[name] / seconds[name] / peak if flops[name] else None} for name in PHASES]
    total = sum(flops.values())
    phases.append({"phase": "step", "seconds": step, "share_of_step": 1.0, "gflop": total / 1e9,
                   "gflops": total / step / 1e9, "share_of_peak": total / step / peak})
    from localrl.models.shapes import SHAPES

    weights = "random weights" if model_name.lower() in SHAPES else "its own weights"
    return {"model": model_name, "weights": weights, "shape": {"hidden": shape.hidden, "layers": shape.layers, "vocab": shape.vocab},
            "size": size.__dict__, "micro_batch": micro_batch, "checkpointing": plan.checkpointing, "phases": phases}


def bench_utilisation(models: list[str], size: StepSize, peak_n: int = PEAK_N, compute_dtype: str = "auto",
                      log=print) -> dict:
    """The machine's matrix peak (float32; bfloat16 where native or asked for) and each model's step computing in
    ``compute_dtype``, phase by phase, against that dtype's peak."""
    if min(size.prompts, size.prompt_len, size.completion_len) < 1 or size.group < 2:
        raise UserError("bench utilisation: need --prompts, --prompt-len, --completion-len >= 1 and --group >= 2")
    threads = torch.get_num_threads()
    dtype, why = precision.resolve(compute_dtype, torch.device("cpu"))
    native = precision.native_bfloat16_cpu()
    peak32 = matmul_peak(torch.float32, peak_n)
    peak16 = matmul_peak(torch.bfloat16, peak_n) if native or dtype == torch.bfloat16 else None
    log(f"machine: {threads} threads; {peak_n}x{peak_n} matrix product, best of 5: float32 {peak32 / 1e9:.1f} GFLOP/s; "
        + (f"bfloat16 {peak16 / 1e9:.1f} GFLOP/s ({peak16 / peak32:.2f}x)" if peak16 is not None else
           "bfloat16 not native on this CPU (no AVX-512 BF16 or AMX): not measured")
        + ("" if native or peak16 is None else " (not native on this CPU: converted to float32 and back)"))
    log(f"the steps: {why}, against the {'bfloat16' if dtype == torch.bfloat16 else 'float32'} peak")
    peak = peak16 if dtype == torch.bfloat16 else peak32
    results = []
    for name in models:
        row = bench_model(name, size, peak, compute_dtype=compute_dtype, log=log)
        results.append(row)
        s = row["shape"]
        log(f"\n{name} (hidden {s['hidden']}, {s['layers']} layers, vocab {s['vocab']}), {row['weights']}, "
            f"unquantised, {str(dtype).removeprefix('torch.')} compute; {size.prompts} prompts x G={size.group}, "
            f"P={size.prompt_len}, R={size.completion_len}; "
            f"micro-batch {row['micro_batch']}, checkpointing {'on' if row['checkpointing'] else 'off'}")
        log(f"{'phase':<19} {'seconds':>8} {'of step':>8} {'GFLOP':>8} {'GFLOP/s':>8} {'of peak':>8}")
        for p in row["phases"]:
            rate = "-" if p["gflops"] is None else f"{p['gflops']:.1f}"
            share = "-" if p["share_of_peak"] is None else f"{100 * p['share_of_peak']:.1f}%"
            log(f"{p['phase']:<19} {p['seconds']:>8.3f} {100 * p['share_of_step']:>7.1f}% {p['gflop']:>8.2f} "
                f"{rate:>8} {share:>8}")
    return {"threads": threads, "peak_n": peak_n, "compute_dtype": str(dtype).removeprefix("torch."),
            "float32_gflops": peak32 / 1e9,
            "bfloat16_gflops": None if peak16 is None else peak16 / 1e9, "models": results}
