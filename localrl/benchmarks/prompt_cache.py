"""``localrl bench prompt-cache``: the training forward and backward of one GRPO group with the naive concatenated
forward and with the shared-prompt forward, on the same 4-bit + LoRA model; each one's time and peak memory."""

from __future__ import annotations

import statistics
import time

import torch

from localrl.benchmarks.harness import BENCH_SHAPE, PeakMemory, bench_model, synthetic_group
from localrl.errors import UserError
from localrl.generation.rollout import Rollout
from localrl.policy.shared_prompt import ConcatForward, SharedPromptForward

PROMPT_CACHE_SHAPES = [(1000, 100, 8), (4000, 64, 8)]  # (P, R, G)


def _fwd_bwd(model, rollout: Rollout, forward_cls, micro_batch: int) -> None:
    model.zero_grad(set_to_none=True)
    n = rollout.completion_ids.size(0)
    with forward_cls(model, rollout) as fwd:
        for i in range(0, n, micro_batch):
            fwd.logprobs(slice(i, min(i + micro_batch, n))).sum().backward()


def bench_prompt_cache(shapes: list[tuple[int, int, int]] = PROMPT_CACHE_SHAPES, repeats: int = 3,
                       device: str = "cpu", log=print, model_shape: dict = BENCH_SHAPE) -> list[dict]:
    """Naive vs shared-prompt forward+backward: median time and peak memory per (P, R, G)."""
    for p, r, g in shapes:
        if p < 1 or r < 1 or g < 2:
            raise UserError(f"bench prompt-cache: shape P={p} R={r} G={g}: need P, R >= 1 and G >= 2")
    if repeats < 1:
        raise UserError("bench prompt-cache: need --repeats >= 1")
    dev = torch.device(device)
    model = bench_model(dev, shape=model_shape)
    rows = []
    log(f"{'P':>5} {'R':>4} {'G':>2} | {'naive s':>8} {'cached s':>8} {'speedup':>7} {'limit':>5} | "
        f"{'naive MB':>8} {'cached MB':>9} {'mem ratio':>9} | {'RSS ratio':>9}")
    for p, r, g in shapes:
        rollout = synthetic_group(p, r, g, model.config.vocab_size)
        variants = {"naive": (ConcatForward, g), "cached": (SharedPromptForward, g)}
        _fwd_bwd(model, rollout, SharedPromptForward, g)  # warm-up
        times = {k: [] for k in variants}
        for _ in range(repeats):  # interleaved, so drift in machine load hits both alike
            for name, (cls, mb) in variants.items():
                t0 = time.perf_counter()
                _fwd_bwd(model, rollout, cls, mb)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
        peaks, rss = {}, {}
        for name, (cls, mb) in variants.items():
            with PeakMemory(dev) as mem:
                _fwd_bwd(model, rollout, cls, mb)
            peaks[name] = mem.peak
            with PeakMemory(dev, rss=True) as mem:
                _fwd_bwd(model, rollout, cls, mb)
            rss[name] = mem.peak
        t_naive, t_cached = statistics.median(times["naive"]), statistics.median(times["cached"])
        row = {"P": p, "R": r, "G": g, "naive_s": t_naive, "cached_s": t_cached, "speedup": t_naive / t_cached,
               "token_limit": g * (p + r) / (p + g * r), "naive_bytes": peaks["naive"],
               "cached_bytes": peaks["cached"], "memory_ratio": peaks["naive"] / max(peaks["cached"], 1),
               "naive_rss_bytes": rss["naive"], "cached_rss_bytes": rss["cached"]}
        rows.append(row)
        rss_ratio = f"{rss['naive'] / max(rss['cached'], 1):>8.2f}x" if dev.type == "cpu" else ""
        log(f"{p:>5} {r:>4} {g:>2} | {t_naive:>8.2f} {t_cached:>8.2f} {row['speedup']:>6.2f}x "
            f"{row['token_limit']:>4.1f}x | {peaks['naive'] / 2**20:>8.0f} {peaks['cached'] / 2**20:>9.0f} "
            f"{row['memory_ratio']:>8.2f}x | {rss_ratio}")
    return rows
