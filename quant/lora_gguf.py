"""A LoRA adapter as a GGUF adapter file, the form llama.cpp loads with ``--lora`` (and
``llama_adapter_lora_init``) on top of a base GGUF, without merging.

Layout, as llama.cpp's own converter writes it: ``general.type = adapter``,
``adapter.type = lora``, ``adapter.lora.alpha``; for every adapted base weight
``blk.N.attn_q.weight``, two F32 tensors ``...weight.lora_a`` (PEFT's lora_A, [rank, in]) and
``...weight.lora_b`` (lora_B, [out, rank]). Llama's q/k projections are permuted to
llama.cpp's rotary layout in the base file, so their lora_b rows are permuted the same way.
llama.cpp scales the product by alpha / rank, as PEFT does.
"""

from __future__ import annotations

import re
from pathlib import Path

from localrl.errors import UserError
from localrl.quant.gguf_writer import ARCHITECTURES, _permute_rotary, check_architecture, gguf_file

_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight$")


def write_lora_gguf(adapter_state: dict, config, alpha: float, out: Path) -> Path:
    """Write PEFT adapter weights (``get_peft_model_state_dict`` or a PeftModel's state dict: the lora_A and
    lora_B tensors) for a base of ``config`` as a GGUF adapter at ``out`` (atomically)."""
    import gguf
    import numpy as np

    check_architecture(config)
    arch = gguf.MODEL_ARCH[ARCHITECTURES[config.model_type]]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in adapter_state.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            continue
        base, ab = match.groups()
        pairs.setdefault(base, {})[ab] = tensor.detach().float().cpu().numpy()
    if not pairs:
        raise UserError("export: the adapter has no LoRA weights")
    out = Path(out)
    with gguf_file(out, arch) as writer:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        for base, ab in sorted(pairs.items()):
            name = names.get_name(base + ".weight", try_suffixes=(".weight",))
            if name is None or set(ab) != {"A", "B"}:
                raise UserError(f"export: no GGUF name for adapted weight {base!r}")
            lora_b = ab["B"]
            if arch == gguf.MODEL_ARCH.LLAMA and base.endswith(("q_proj", "k_proj")):
                lora_b = _permute_rotary(lora_b, n_head if base.endswith("q_proj") else n_kv)
            writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(ab["A"]))
            writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(lora_b))
    return out
