"""Load a causal LM for GRPO: base weights in 4-bit NF4 (bitsandbytes) with LoRA adapters (peft).

A model is named by a built-in name, a local Hugging Face directory, or a hub id. The
name is resolved and its config checked (architecture, files) before any weight is read,
so a wrong name costs one clear line, not a traceback after a long load.

Deliberate simplifications: one device (CPU or one CUDA GPU); on the CPU everything
computes in float32, on a GPU the 4-bit layers compute in bfloat16 while the LoRA weights
stay float32. Unsloth is imported only when ``unsloth=True``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from localrl.errors import UserError
from models import builtin_names, builtin_path
from quant.nf4 import keep_trainable_layout, nf4_config

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def resolve_model(name: str) -> str:
    """A local directory for built-in names and paths, or the hub id unchanged."""
    builtin = builtin_path(name)
    if builtin is not None:
        if not (builtin / "config.json").is_file():
            raise UserError(f"model {name!r}: built-in model is not built; run `localrl models build {name}`")
        return str(builtin)
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise UserError(f"model {name!r}: not a Hugging Face model directory (no config.json)")
        return str(p)
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise UserError(f"model {name!r}: no such directory, and not a built-in model ({', '.join(builtin_names())})")
    return name


def load_config(name: str):
    """(resolved path or id, transformers config), checked to be a supported architecture."""
    from transformers import AutoConfig

    path = resolve_model(name)
    local = Path(path).exists()
    if not local and not _hub_reachable():
        raise UserError(f"model {name!r}: not found locally and the Hugging Face Hub is unreachable (offline?)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        if local:
            raise UserError(f"model {name!r}: cannot read config.json ({str(e).splitlines()[0]})") from None
        raise UserError(f"model {name!r}: not found locally and could not be fetched from the Hugging Face Hub "
                        f"(offline or no such repo)") from None
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"model {name!r}: unsupported architecture {config.model_type!r}; "
                        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return path, config


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick connection check, so an offline machine fails in seconds rather than after retries.

    With HF_HUB_OFFLINE set, only the local cache is consulted, and that answers at once.
    """
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def pick_device(preference: str = "auto") -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("device 'cuda': no CUDA GPU is available")
        return torch.device("cuda")
    return torch.device("cpu")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_base(path: str, load_in_4bit: bool, device: torch.device):
    """The base model, frozen, with its linear layers in NF4 when ``load_in_4bit``."""
    from transformers import AutoModelForCausalLM

    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kwargs = {"dtype": compute_dtype, "device_map": {"": device.type}}
    if load_in_4bit:
        kwargs["quantization_config"] = nf4_config(compute_dtype)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if load_in_4bit and keep_trainable_layout(model) == 0:
        raise RuntimeError("4-bit load produced no Linear4bit layers")
    model.requires_grad_(False)
    model.eval()
    return model


def lora_targets(spec: str) -> str | list[str]:
    return "all-linear" if spec == "all-linear" else [s.strip() for s in spec.split(",") if s.strip()]


def load_policy(cfg, device: torch.device):
    """(model with fresh trainable LoRA adapters, tokenizer) for a TrainConfig."""
    path, _ = load_config(cfg.model)
    if cfg.unsloth:
        return _load_unsloth(path, cfg, device)
    from peft import LoraConfig, get_peft_model

    tok = load_tokenizer(path)
    base = load_base(path, cfg.load_in_4bit, device)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=lora_targets(cfg.lora_targets), task_type="CAUSAL_LM")
    try:
        model = get_peft_model(base, lora)
    except ValueError as e:
        raise UserError(f"config field lora_targets: {str(e).splitlines()[0]}") from None
    return model, tok


def load_adapter(model_name: str, adapter_dir: str | Path, load_in_4bit: bool, device: torch.device):
    """(base + a saved PEFT adapter, tokenizer), for evaluation."""
    from peft import PeftModel

    path, _ = load_config(model_name)
    tok = load_tokenizer(path)
    base = load_base(path, load_in_4bit, device)
    return PeftModel.from_pretrained(base, str(adapter_dir)), tok


def _load_unsloth(path: str, cfg, device: torch.device):
    if device.type != "cuda":
        raise UserError("config field unsloth: Unsloth needs a CUDA GPU")
    try:
        from unsloth import FastLanguageModel
    except ImportError:
        raise UserError("config field unsloth: Unsloth is not installed (pip install 'localrl[unsloth]')") from None
    os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")
    model, tok = FastLanguageModel.from_pretrained(path, load_in_4bit=cfg.load_in_4bit, max_seq_length=4096)
    targets = LINEAR_MODULES if cfg.lora_targets == "all-linear" else lora_targets(cfg.lora_targets)
    model = FastLanguageModel.get_peft_model(model, r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                             lora_dropout=cfg.lora_dropout, target_modules=targets,
                                             random_state=cfg.seed)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok
