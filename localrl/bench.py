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

from localrl.errors import UserError
from localrl.prompt_cache import ConcatForward, SharedPromptForward
from localrl.rollout import Rollout

PROMPT_CACHE_SHAPES = [(1000, 100, 8), (4000, 64, 8)]
# The Qwen2-style model both timing benchmarks use (random weights; ~3M parameters besides embeddings).
BENCH_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, max_position_embeddings=8192)


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

    config = Qwen2Config(vocab_size=8192, **BENCH_SHAPE)
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


def _bench_policy_dir(root: Path, vocab_tokenizer) -> Path:
    """A random Qwen2-style model (the bench shape) with the built-in byte tokenizer, no chat template."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = vocab_tokenizer
    tok.chat_template = None  # prompts are raw text, so both trainers see exactly P tokens
    config = Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None, **BENCH_SHAPE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def distinct_chars(completions, **_) -> list[float]:
    """A reward that differs between random completions, so every step has a learning signal."""
    return [float(len(set(c))) for c in completions]


def bench_grpo_step(prompt_len: int = 1000, completion_len: int = 100, group: int = 8, steps: int = 3,
                    log=print) -> dict:
    """Whole GRPO steps (generation, scoring, update) of localrl and of TRL's GRPOTrainer, same model.

    Both get one prompt of ``prompt_len`` tokens per step, G completions of exactly
    ``completion_len`` tokens (no stop token can end them early), the same reward, a 4-bit
    NF4 base with the same LoRA adapters, beta = 0, one optimisation pass. The first step
    of each is a warm-up; the median of the rest is reported.
    """
    import random
    import tempfile

    from peft import LoraConfig, get_peft_model

    from localrl.config import TrainConfig
    from localrl.modeling import load_base, load_tokenizer
    from localrl.tasks import Task
    from localrl.trainer import train_step
    from models.recipe import build_tokenizer

    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        raise UserError("bench grpo-step: needs TRL (pip install -e '.[bench]')") from None

    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefghij klmnopqrst") for _ in range(prompt_len)) for _ in range(steps + 1)]
    rows = [{"prompt": p, "answer": "0"} for p in prompts]
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    device = torch.device("cpu")

    with tempfile.TemporaryDirectory() as tmp:
        path = str(_bench_policy_dir(Path(tmp) / "model", build_tokenizer()))
        tok = load_tokenizer(path)
        assert all(len(tok(p)["input_ids"]) == prompt_len for p in prompts)

        # localrl: its own step function, stop tokens disabled so every completion has R tokens
        cfg = TrainConfig(model=path, data="rows", prompts_per_step=1, group_size=group,
                          max_new_tokens=completion_len, beta=0.0, eval_size=0).validate()
        torch.manual_seed(0)
        model = get_peft_model(load_base(path, True, device), lora)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
        task = Task("rows", rows, [])
        rewards, weights = [distinct_chars], [1.0]
        ours = []
        for step in range(steps + 1):
            t0 = time.perf_counter()
            train_step(model, tok, optimizer, task, step, cfg, rewards, weights, stops=[])
            ours.append(time.perf_counter() - t0)
        log(f"localrl steps (s): {', '.join(f'{t:.2f}' for t in ours)}")
        del model, optimizer
        gc.collect()

        # TRL: GRPOTrainer on the same 4-bit base with the same adapters
        class StepTimer(TrainerCallback):
            def __init__(self):
                self.times, self._t0 = [], 0.0

            def on_step_begin(self, args, state, control, **kw):
                self._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                self.times.append(time.perf_counter() - self._t0)

        timer = StepTimer()
        torch.manual_seed(0)
        trl_model = get_peft_model(load_base(path, True, device), lora)
        trl_model.train()
        args = GRPOConfig(output_dir=str(Path(tmp) / "trl"), use_cpu=True, num_generations=group,
                          per_device_train_batch_size=group, gradient_accumulation_steps=1,
                          max_completion_length=completion_len, generation_kwargs={"min_new_tokens": completion_len},
                          max_steps=steps + 1, beta=0.0, learning_rate=cfg.lr, logging_steps=1000, report_to="none",
                          save_strategy="no", bf16=False, fp16=False, shuffle_dataset=False, seed=0,
                          disable_tqdm=True)
        trainer = GRPOTrainer(model=trl_model, reward_funcs=rewards[0], args=args,
                              train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[timer])
        trainer.train()
        log(f"TRL steps (s):     {', '.join(f'{t:.2f}' for t in timer.times)}")

    t_ours, t_trl = statistics.median(ours[1:]), statistics.median(timer.times[1:])
    result = {"P": prompt_len, "R": completion_len, "G": group, "localrl_s": t_ours, "trl_s": t_trl,
              "speedup": t_trl / t_ours}
    log(f"whole GRPO step, P={prompt_len} R={completion_len} G={group}: localrl {t_ours:.2f} s, "
        f"TRL GRPOTrainer {t_trl:.2f} s -> localrl {t_trl / t_ours:.2f}x faster")
    return result


def bench_export(source: str = "tiny-arith", log=print) -> list[dict]:
    """Export ``source`` to every quant type; time, file size and the llama.cpp validation figures of each."""
    import tempfile

    from quant.export import export, load_merged
    from quant.gguf_check import check_gguf
    from quant.gguf_writer import K_QUANT_TYPES, QUANT_TYPES

    model, tok, _, _ = load_merged(source)  # the torch reference every file is compared with
    rows = []
    log(f"{'type':<7} {'export s':>8} {'MiB':>6} | {'tokens':>6} {'top-1':>6} {'max|dlogit|':>11} "
        f"{'of range':>8} {'greedy':>6} | result")
    with tempfile.TemporaryDirectory() as tmp:
        for quant in [*QUANT_TYPES, *K_QUANT_TYPES]:
            out = Path(tmp) / f"{quant}.gguf"
            t0 = time.perf_counter()
            result = export(source, out, quant, check=False, log=lambda *_: None)
            seconds = time.perf_counter() - t0
            r = check_gguf(result.path, model, tok, quant)
            row = {"quant": quant, "export_s": seconds, "bytes": out.stat().st_size, "tokens_identical":
                   r.tokens_identical, "top1": r.top1_agreement, "max_abs_logit_diff": r.max_abs_logit_diff,
                   "rel_logit_error": r.rel_logit_error, "greedy_identical": r.greedy_identical, "passed": r.passed}
            rows.append(row)
            log(f"{quant:<7} {seconds:>8.2f} {row['bytes'] / 2**20:>6.2f} | "
                f"{'same' if r.tokens_identical else 'DIFF':>6} {r.top1_agreement:>6.1%} "
                f"{r.max_abs_logit_diff:>11.4f} {r.rel_logit_error:>8.2%} "
                f"{'same' if r.greedy_identical else 'diff':>6} | {'pass' if r.passed else 'FAIL'}")
    return rows
