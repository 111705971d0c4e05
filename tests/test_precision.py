"""compute_dtype: what the base computes in, chosen per machine, and what stays float32 under bfloat16."""

import platform
from pathlib import Path

import pytest
import torch

from localrl.config import TrainConfig
from localrl.errors import UserError
from localrl.memory import MemoryBudget, ModelShape
from localrl.modeling import load_config, load_policy
from localrl.policy.shared_prompt import SharedPromptForward
from localrl.precision import NATIVE_ENV, native_bfloat16_cpu, resolve
from tests.test_prompt_cache import make_rollout

CPU = torch.device("cpu")


def test_auto_is_bfloat16_on_a_gpu_and_float32_on_every_cpu(monkeypatch):
    assert resolve("float32", CPU)[0] == torch.float32 and resolve("bfloat16", CPU)[0] == torch.bfloat16
    assert resolve("auto", CPU) == (torch.float32, resolve("auto", CPU)[1])  # as conftest.py pins the detection
    monkeypatch.delenv(NATIVE_ENV)
    native = native_bfloat16_cpu()
    flags = (Path("/proc/cpuinfo").read_text().split("\nflags", 1) + [""])[1].split("\n", 1)[0].split()
    if platform.machine() == "x86_64":  # torch's probe agrees with what the kernel lists
        assert native == bool({"avx512_bf16", "amx_bf16"} & set(flags))
    dtype, why = resolve("auto", CPU)
    assert dtype == torch.float32  # (native or not: precision.py says why)
    assert ("multiplies bfloat16 natively, but" if native else "no native bfloat16") in why
    monkeypatch.setenv(NATIVE_ENV, "1")
    assert resolve("auto", CPU)[0] == torch.float32 and "--compute-dtype bfloat16" in resolve("auto", CPU)[1]
    assert resolve("auto", torch.device("cuda"))[0] == torch.bfloat16
    with pytest.raises(UserError, match="compute_dtype"):
        TrainConfig(compute_dtype="half").validate()


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_under_bfloat16_only_the_base_computes_in_it(builtin_model, quantize):
    """The base's weights (or its 4-bit layers' products) in bfloat16; the adapter, its gradients and the
    log-probabilities float32; the planner counts the base's activations at 2 bytes."""
    import bitsandbytes as bnb

    cfg = TrainConfig(model=str(builtin_model), quantize=quantize, compute_dtype="bfloat16").validate()
    torch.manual_seed(0)
    model, tok = load_policy(cfg, CPU)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert torch.bfloat16 in frozen and torch.float32 not in frozen
    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert (quantize == "nf4") == bool(four_bit) and all(m.compute_dtype == torch.bfloat16 for m in four_bit)
    rollout = make_rollout(len(tok), tok.pad_token_id)
    with SharedPromptForward(model, rollout) as fwd:
        logp = fwd.logprobs(slice(0, 4))
        logp.sum().backward()
    assert logp.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in trainable)
    shape = ModelShape.from_config(load_config(str(builtin_model))[1])
    half, full = (MemoryBudget(shape, TrainConfig(compute_dtype=d).validate(), CPU, False)
                  for d in ("bfloat16", "float32"))
    assert half.dtype_bytes == 2 and full.dtype_bytes == 4 and half.held < full.held
