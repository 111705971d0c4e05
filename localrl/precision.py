"""The number format the frozen base computes in (``compute_dtype``), chosen once per run.

bfloat16 halves the base's weights and activations and, where the silicon multiplies it natively,
runs its products faster than float32: on a CUDA GPU, and on CPUs with AVX-512 BF16 or AMX (x86) or
the BF16 extension (ARM). Elsewhere a CPU converts every bfloat16 product to float32 and back, which
is slower than float32 itself.

"auto" is bfloat16 on a GPU and float32 on every CPU, for now even where the CPU multiplies bfloat16:
on such a CPU (a 2-core Xeon with AMX, 2026-12-07) the README's SmolLM2-135M command in bfloat16 ran
within its 4 GiB budget once the planner counted llama.cpp's context right, 1.1x faster than float32,
but did not learn (7.0% -> 6.5%, an earlier run 12.5%, against float32's 23.0-25.0%): its
log-probabilities differ from float32's ten times more than the llama.cpp sampler's. And the planner
still under-predicts a bfloat16 run's torch-decoding phases on a CPU (`localrl bench memory
--compute-dtype bfloat16`: load 1.45x, evaluation 2.0x, rollout 1.44x). ``--compute-dtype bfloat16``
asks for it anyway (docs/performance.md).

Only the base computes in bfloat16. The LoRA weights, their gradients and AdamW state stay float32
(peft keeps an adapter in float32 on a bfloat16 base), and the logits are upcast before any
log-softmax, so log-probabilities, ratios, advantages and the loss are float32 under either choice.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from localrl.errors import UserError

CHOICES = ("auto", "float32", "bfloat16")
# "1" or "0" overrides the detection below (a CPU it misreads; the test suite sets "0", so that its float32
# tolerances hold on every machine and only the tests that ask for bfloat16 get it)
NATIVE_ENV = "LOCALRL_CPU_BFLOAT16"


def native_bfloat16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware: AVX-512 BF16 or AMX on x86, BF16 on ARM (or what
    ``$LOCALRL_CPU_BFLOAT16`` says)."""
    if os.environ.get(NATIVE_ENV) in ("0", "1"):
        return os.environ[NATIVE_ENV] == "1"
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        known = [getattr(torch.cpu, name) for name in probes if hasattr(torch.cpu, name)]
        if known:
            return any(probe() for probe in known)
        return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())
    if machine in ("aarch64", "arm64"):
        return "bf16" in _cpu_flags()
    return False


def _cpu_flags() -> set[str]:
    """The flags (x86) or features (ARM) /proc/cpuinfo lists for the first CPU; empty where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    except OSError:
        pass
    return set()


def compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype ``setting`` (one of CHOICES) means on ``device``."""
    return resolve(setting, device)[0]


def resolve(setting: str, device: torch.device) -> tuple[torch.dtype, str]:
    """(dtype, the choice in words for the run's first lines)."""
    if setting not in CHOICES:
        raise UserError(f"config field compute_dtype: {setting!r} is not one of {', '.join(CHOICES)}",
                        field="compute_dtype")
    if setting != "auto":
        return getattr(torch, setting), f"compute_dtype = {setting}"
    if device.type == "cuda":
        return torch.bfloat16, "bfloat16 compute (a GPU)"
    if native_bfloat16_cpu():
        return torch.float32, ("float32 compute (this CPU multiplies bfloat16 natively, but bfloat16 has not yet "
                               "learned as float32 does on a CPU: --compute-dtype bfloat16 asks for it)")
    return torch.float32, "float32 compute (this CPU has no native bfloat16: no AVX-512 BF16 or AMX)"
