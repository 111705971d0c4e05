"""Random-weight models in the published shapes of the small models people fine-tune.

Memory and time depend on a model's shape, not on its trained values, so a model directory
with random weights in Qwen2.5-1.5B's configuration measures what a Qwen2.5-1.5B run needs
without downloading it. ``localrl models shape NAME --out DIR`` writes one: config.json as
published (architecture, sizes, vocabulary, rotary settings, tied embeddings), weights
drawn from the architecture's own initialiser, stored in bfloat16 (as the published
checkpoints are), and a working tokenizer: the built-in one, or a real one given by
``--tokenizer`` (a model directory or a tokenizer.json).

Random weights almost never sample a stop token, so every completion runs to its length
limit: the worst case for time and memory, which is what a budget must survive.

The parameter counts below are the model cards' (rounded as published); a test checks that
each configuration builds a model within 1% of it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from localrl.errors import UserError


@dataclass(frozen=True)
class Shape:
    config: dict  # config.json fields beyond the defaults of its architecture
    published_params: int  # the model card's figure


_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
          "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False}

SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape({**_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                           "num_attention_heads": 14, "num_key_value_heads": 2}, 490_000_000),
    "qwen2.5-1.5b": Shape({**_QWEN2, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                           "num_attention_heads": 12, "num_key_value_heads": 2}, 1_540_000_000),
    "qwen2.5-3b": Shape({**_QWEN2, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                         "num_attention_heads": 16, "num_key_value_heads": 2}, 3_090_000_000),
    "llama-3.2-1b": Shape({**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                           "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
                           "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                           "tie_word_embeddings": True}, 1_230_000_000),
    "smollm2-135m": Shape({**_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                           "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                           "max_position_embeddings": 8192, "rope_theta": 100000.0,
                           "tie_word_embeddings": True}, 135_000_000),
    "smollm2-360m": Shape({**_LLAMA, "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                           "num_attention_heads": 15, "num_key_value_heads": 5, "vocab_size": 49152,
                           "max_position_embeddings": 8192, "rope_theta": 100000.0,
                           "tie_word_embeddings": True}, 362_000_000),
}


def shape_names() -> list[str]:
    return list(SHAPES)


def find_shape(name: str) -> Shape:
    key = name.lower()
    if key not in SHAPES:
        raise UserError(f"model shape {name!r}: not known; known shapes: {', '.join(SHAPES)}")
    return SHAPES[key]


def _tokenizer_source(tokenizer: str | None) -> Path:
    """The directory whose tokenizer files are copied: ``tokenizer`` (a directory, or a tokenizer.json's
    directory), or the built-in tiny-arith's."""
    from localrl.models import builtin_path

    if not tokenizer:
        return builtin_path("tiny-arith")
    p = Path(tokenizer).expanduser()
    if p.is_file() and p.name == "tokenizer.json":
        return p.parent
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return p
    raise UserError(f"--tokenizer {tokenizer}: no tokenizer.json there (give a model directory or a tokenizer.json)")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def write_shape(name: str, out: str | Path, tokenizer: str | None = None, seed: int = 0, log=print) -> Path:
    """Write a random-weight model of shape ``name`` to ``out`` (atomically); returns ``out``."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from localrl.atomic import atomic_dir

    shape = find_shape(name)
    source = _tokenizer_source(tokenizer)
    tok = AutoTokenizer.from_pretrained(source)  # a tokenizer that does not load stops here, before the weights
    fields = dict(shape.config)
    model_type = fields.pop("model_type")
    if len(tok) > fields["vocab_size"]:
        raise UserError(f"--tokenizer {tokenizer}: {len(tok)} tokens do not fit the {fields['vocab_size']}-token "
                        f"vocabulary of {name}")
    eos = tok.convert_tokens_to_ids(tok.eos_token) if tok.eos_token else None
    pad = tok.convert_tokens_to_ids(tok.pad_token) if tok.pad_token else eos
    config = AutoConfig.for_model(model_type, **fields, bos_token_id=tok.bos_token_id, eos_token_id=eos,
                                  pad_token_id=pad, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    log(f"{name}: building {shape.published_params / 1e9:.2f}B parameters (random, bfloat16)")
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    out = Path(out)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in TOKENIZER_FILES:
            if (source / f).is_file() and not (f == "generation_config.json"):
                shutil.copy(source / f, tmp / f)
        (tmp / "shape.json").write_text(json.dumps({"shape": name, "seed": seed, "tokenizer": str(source),
                                                    "published_params": shape.published_params,
                                                    "params": model.num_parameters()}, indent=1) + "\n")
        tmp.chmod(0o755)  # as any directory a user makes (the temporary one is private)
        for f in tmp.iterdir():
            f.chmod(0o644)
    return out
