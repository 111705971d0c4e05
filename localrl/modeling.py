"""Load a causal LM for GRPO: base weights in 4-bit NF4 (bitsandbytes) with LoRA adapters (peft).

NF4 with double quantisation, as in QLoRA: 4-bit normal-float codes in blocks of 64 with
quantised block scales, dequantised to the compute dtype at every forward.

A model is named by a built-in name, a local Hugging Face directory, a GGUF file or an
Ollama model (``ollama:NAME[:TAG]``; both converted once to a cached directory by
quant/gguf_import.py), or a hub id. The name is resolved and its config checked
(architecture, files) before any weight is read, so a wrong name costs one clear line, not a
traceback after a long load.

Deliberate simplifications: one device (CPU or one CUDA GPU); the base computes in the run's
``compute_dtype`` (by default bfloat16 on a GPU and float32 on a CPU: localrl/precision.py) while the
LoRA weights stay float32. Unsloth is imported only when ``unsloth=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from localrl import precision
from localrl.errors import UserError, first_line
from localrl.models import builtin_names, builtin_path

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def resolve_model(name: str, log=print) -> str:
    """A local directory for built-in names, paths and GGUF files (converted once, cached), or the hub id
    unchanged."""
    from localrl.quant.gguf_import import is_gguf_source, model_dir

    if is_gguf_source(name):
        return str(model_dir(name, log))
    builtin = builtin_path(name)
    if builtin is not None:
        if not (builtin / "config.json").is_file():
            raise UserError(f"model {name!r}: built-in model is not built; run `localrl models build {name}`",
                            field="model")
        return str(builtin)
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise UserError(f"model {name!r}: not a Hugging Face model directory (no config.json)",
                            field="model")
        return str(p)
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise UserError(f"model {name!r}: no such directory, and not a built-in model "
                        f"({', '.join(builtin_names())})", field="model")
    return name


def check_source(name: str) -> None:
    """The one line ``resolve_model`` (or a GGUF's header) gives for a model that is not there, without converting
    or loading anything: for a command that says what it will do before it loads the model."""
    from localrl.quant.gguf_import import gguf_path, is_gguf_source
    from localrl.quant.gguf_info import read_gguf_info

    if is_gguf_source(name):
        read_gguf_info(gguf_path(name))
    else:
        resolve_model(name)


def load_config(name: str):
    """(resolved path or id, transformers config), checked to be a supported architecture."""
    from transformers import AutoConfig

    path = resolve_model(name)
    local = Path(path).exists()
    if not local and not _hub_reachable():
        raise UserError(f"model {name!r}: not found locally and the Hugging Face Hub is unreachable (offline?)",
                        field="model")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        if local:
            raise UserError(f"model {name!r}: cannot read config.json ({first_line(e)})", field="model") from None
        raise UserError(f"model {name!r}: not found locally and could not be fetched from the Hugging Face Hub "
                        f"(offline or no such repo)", field="model") from None
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"model {name!r}: unsupported architecture {config.model_type!r}; "
                        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}", field="model")
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
            raise UserError("config field device: 'cuda' asked for, but no CUDA GPU is available", field="device")
        return torch.device("cuda")
    return torch.device("cpu")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_base(path: str, load_in_4bit: bool, device: torch.device, dtype: str = "auto"):
    """The base model, frozen, with its linear layers in NF4 when ``load_in_4bit``, computing in the dtype the
    ``compute_dtype`` setting ``dtype`` means on ``device`` (localrl/precision.py)."""
    compute_dtype = precision.compute_dtype(dtype, device)
    # the whole model on this one device (a rank's own GPU under torchrun): never "auto", which would
    # split it across GPUs
    kwargs = {"dtype": compute_dtype, "device_map": {"": str(device)}}
    if load_in_4bit:
        kwargs["quantization_config"] = nf4_config(compute_dtype)
    model = _from_pretrained(path, **kwargs)
    if load_in_4bit and keep_trainable_layout(model) == 0:
        raise RuntimeError("4-bit load produced no Linear4bit layers")
    model.requires_grad_(False)
    model.eval()
    return model


# -- 4-bit NF4 (bitsandbytes) ---------------------------------------------------------------

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


def load_full(path: str):
    """The model's own weights in float32 on the CPU (for merging and export, never quantised)."""
    return _from_pretrained(path, dtype=torch.float32)


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The frozen base weights of a PEFT policy under the base model's own (Hugging Face) names, as the
    policy holds them (views, no copy), or None where the base is not plain full-precision tensors (4-bit
    NF4 layers): what the llama.cpp sampler is written from without loading the model a second time."""
    if count_4bit_layers(model):
        return None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {name.replace(".base_layer.", "."): t for name, t in inner.state_dict().items() if ".lora_" not in name}


def _from_pretrained(path: str, **kwargs):
    from transformers import AutoModelForCausalLM

    check_weights(path)
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # damaged or mismatched weight files
        if not Path(path).exists():
            raise
        raise UserError(f"model {path}: cannot load its weights ({first_line(e)})", field="model") from None


# -- weight files ------------------------------------------------------------------------------

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def weight_files(path: str | Path) -> list[Path]:
    p = Path(path)
    return sorted(f for f in p.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file()) if p.is_dir() else []


def check_weights(path: str | Path) -> None:
    """Check a local model's safetensors files are whole (header readable, data as long as it says)
    in milliseconds, so a truncated or foreign file stops before any run directory or weights load."""
    files = weight_files(path)
    if Path(path).is_dir() and not files:
        raise UserError(f"model {path}: no weight files (*.safetensors or *.bin)", field="model")
    for f in files:
        if f.suffix != ".safetensors":
            continue
        size = f.stat().st_size
        try:
            with f.open("rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 2 <= n <= min(size - 8, 100 * 2**20):
                    raise ValueError("no safetensors header")
                header = json.loads(fh.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
            raise UserError(f"model {path}: {f.name} is not a readable safetensors file ({first_line(e)})",
                            field="model") from None
        if 8 + n + end > size:
            raise UserError(f"model {path}: {f.name} is truncated ({size} bytes, its header needs {8 + n + end})",
                            field="model")


def weights_fingerprint(path: str | Path, samples: int = 64, chunk: int = 1 << 16) -> str | None:
    """A fingerprint of a local model's weight files: their names and sizes and ``samples`` chunks
    spread over each (all of a small file). Cheap on a 10 GB model; two trainings of one shape differ."""
    files = weight_files(path)
    if not files:
        return None
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            if size <= samples * chunk:
                h.update(fh.read())
                continue
            for i in range(samples):
                fh.seek(i * (size - chunk) // (samples - 1))
                h.update(fh.read(chunk))
    return h.hexdigest()


def default_4bit(quantize: str, device: torch.device) -> bool:
    """``quantize`` as a yes/no without the memory planner: "auto" is NF4 on a GPU, full precision on a CPU."""
    return quantize == "nf4" or (quantize == "auto" and device.type == "cuda")


def lora_targets(spec: str) -> str | list[str]:
    return "all-linear" if spec == "all-linear" else [s.strip() for s in spec.split(",") if s.strip()]


def load_policy(cfg, device: torch.device, in_4bit: bool | None = None):
    """(model with fresh trainable LoRA adapters, tokenizer) for a TrainConfig; the base in 4-bit NF4 when
    ``in_4bit`` (default: as ``quantize`` says, "auto" meaning on a GPU; the trainer decides "auto" with
    the memory planner, memory.choose_4bit)."""
    in_4bit = default_4bit(cfg.quantize, device) if in_4bit is None else in_4bit
    path, _ = load_config(cfg.model)
    if cfg.unsloth:
        return _load_unsloth(path, cfg, device, in_4bit)
    from peft import LoraConfig, get_peft_model

    tok = load_tokenizer(path)
    base = load_base(path, in_4bit, device, cfg.compute_dtype)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=lora_targets(cfg.lora_targets), task_type="CAUSAL_LM")
    try:
        model = get_peft_model(base, lora)
    except ValueError as e:
        raise UserError(f"config field lora_targets: {first_line(e)}", field="lora_targets") from None
    return model, tok


def _load_unsloth(path: str, cfg, device: torch.device, in_4bit: bool):
    if device.type != "cuda":
        raise UserError("config field unsloth: Unsloth needs a CUDA GPU", field="unsloth")
    try:
        from unsloth import FastLanguageModel
    except ImportError:
        raise UserError("config field unsloth: Unsloth is not installed (pip install 'localrl[unsloth]')",
                        field="unsloth") from None
    os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")
    model, tok = FastLanguageModel.from_pretrained(path, load_in_4bit=in_4bit, max_seq_length=4096)
    targets = LINEAR_MODULES if cfg.lora_targets == "all-linear" else lora_targets(cfg.lora_targets)
    model = FastLanguageModel.get_peft_model(model, r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                             lora_dropout=cfg.lora_dropout, target_modules=targets,
                                             random_state=cfg.seed)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok
