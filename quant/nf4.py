"""4-bit NF4 quantisation of base weights through bitsandbytes (CPU and CUDA).

NF4 with double quantisation, as in QLoRA: 4-bit normal-float codes in blocks of 64 with
quantised block scales. ``compute_dtype`` is the dtype the dequantised weights are used
in: float32 on the CPU, bfloat16 on a GPU.
"""

from __future__ import annotations

import torch


def nf4_config(compute_dtype: torch.dtype):
    """transformers' quantization_config for loading a model in NF4."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                              bnb_4bit_use_double_quant=True)


def count_4bit_layers(model: torch.nn.Module) -> int:
    """How many bitsandbytes ``Linear4bit`` layers the model holds."""
    import bitsandbytes as bnb

    return sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def keep_trainable_layout(model: torch.nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference; returns the layers touched.

    On CPUs with AVX512-BF16, a ``Linear4bit`` run in eval mode without gradients repacks
    its weight once into a bf16 inference layout, and from then on uses a kernel that has
    no autograd: gradients through the base weights are silently lost when the model goes
    back to training, and sampling log-probs drift from the training forward's. GRPO
    alternates sampling and training on the same model, so the repacking stays off.
    """
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = False
    return len(layers)
