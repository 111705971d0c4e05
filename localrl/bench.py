"""Benchmarks that print ratios measured side by side in one process (never timed tests).

``localrl bench prompt-cache`` times the training forward+backward of one GRPO group with the
naive concatenated forward and with the shared-prompt forward, on the same 4-bit + LoRA
model, and measures each one's peak memory.

Peak memory is the peak of live tensor allocations above the level before the run: on the
CPU replayed from the allocation events of torch's profiler, on CUDA the caching
allocator's ``max_memory_allocated``. The CPU resident-set peak is printed beside it; it
is larger, since glibc's heap keeps some freed memory.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from pathlib import Path

import torch

from localrl.prompt_cache import ConcatForward, SharedPromptForward
from localrl.rollout import Rollout

PROMPT_CACHE_SHAPES = [(1000, 100, 8), (4000, 64, 8)]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """Context manager measuring the peak bytes allocated inside it above the level at entry.

    CUDA: the caching allocator's ``max_memory_allocated``. CPU: the allocation and free
    events torch's profiler records (``profile_memory=True``), replayed in time order.
    With ``rss=True`` on the CPU it measures the resident-set high-water mark instead, which
    adds what glibc's heap keeps of freed memory (and no profiler runs).
    """

    def __init__(self, device: torch.device, rss: bool = False):
        self.device, self.rss, self.peak = device, rss and device.type == "cpu", 0

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        elif self.rss:
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            self._base = _rss_kib("VmRSS") * 1024
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        elif self.rss:
            self.peak = _rss_kib("VmHWM") * 1024 - self._base
        else:
            self._prof.__exit__(*exc)
            events = sorted((e.start_ns(), e.nbytes()) for e in self._prof.profiler.kineto_results.events()
                            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
            level = 0
            for _, nbytes in events:
                level += nbytes
                self.peak = max(self.peak, level)
        return False


def bench_model(device: torch.device, load_in_4bit: bool = True):
    """A randomly initialised Qwen2-style model (3M parameters, 8k context) with LoRA adapters."""
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    from localrl.modeling import load_base

    config = Qwen2Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        base = load_base(tmp, load_in_4bit, device)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    return model


def synthetic_group(prompt_len: int, completion_len: int, group: int, vocab: int) -> Rollout:
    g = torch.Generator().manual_seed(prompt_len * 31 + completion_len)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=g)
    completions = torch.randint(0, vocab, (group, completion_len), generator=g)
    return Rollout(prompt, torch.ones_like(prompt), completions, torch.ones_like(completions),
                   torch.zeros(group, dtype=torch.bool), group)


def _fwd_bwd(model, rollout: Rollout, forward_cls, micro_batch: int) -> None:
    model.zero_grad(set_to_none=True)
    n = rollout.completion_ids.size(0)
    with forward_cls(model, rollout) as fwd:
        for i in range(0, n, micro_batch):
            fwd.logprobs(slice(i, min(i + micro_batch, n))).sum().backward()


def bench_prompt_cache(shapes=PROMPT_CACHE_SHAPES, repeats: int = 3, device: str = "cpu", log=print) -> list[dict]:
    """Naive vs shared-prompt forward+backward: median time and peak memory per (P, R, G)."""
    dev = torch.device(device)
    model = bench_model(dev)
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
