"""A GGUF file, or a model in Ollama's store, as a Hugging Face model directory: "fine-tune the model
you already run".

    --model ~/models/SmolLM2-135M-Instruct.Q4_1.gguf     a GGUF file
    --model ollama:smollm2:135m                          Ollama's manifest -> its GGUF blob

transformers reads a GGUF (dequantising every tensor), but the model it builds refuses
``save_pretrained``; its weights are copied into a plain model of the same config and saved,
with the tokenizer, once, in a cache directory keyed by a fingerprint of the file
(``$XDG_CACHE_HOME/localrl/gguf``). Weights are kept in float32 (bfloat16 above 2B parameters).
The conversion's peak is transformers' reading of the file (``memory.conversion_bytes`` predicts it;
a run checks it against its budget before converting).

The tokenizer is transformers' conversion with its pre-tokenizer rebuilt from the split rules
llama.cpp runs for the file's ``tokenizer.ggml.pre`` (transformers keeps only a GPT-2 split and
drops, for example, smollm's digit split). Where llama.cpp is installed, the result is checked
against llama.cpp's tokenisation of the original file on probe texts, and a difference is said.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from localrl.atomic import atomic_dir
from localrl.errors import UserError, first_line
from localrl.quant.gguf_info import read_gguf_info, read_header

OLLAMA_PREFIX = "ollama:"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


def is_gguf_source(name: str) -> bool:
    return name.startswith(OLLAMA_PREFIX) or name.lower().endswith(".gguf")


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "localrl" / "gguf"


def ollama_models_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def ollama_blob(ref: str) -> Path:
    """The GGUF blob of ``ollama:NAME[:TAG]`` (``NAME`` may be ``namespace/name``), from Ollama's manifest."""
    spec = ref[len(OLLAMA_PREFIX):]
    name, _, tag = spec.partition(":")
    if not name:
        raise UserError(f"model {ref!r}: name an Ollama model, for example ollama:smollm2:135m", field="model")
    root = ollama_models_dir()
    if not (root / "manifests").is_dir():
        raise UserError(f"model {ref!r}: no Ollama model store at {root} (set OLLAMA_MODELS, or `ollama pull` first)",
                        field="model")
    repo = name if "/" in name else f"library/{name}"
    manifest = root / "manifests" / "registry.ollama.ai" / repo / (tag or "latest")
    if not manifest.is_file():
        raise UserError(f"model {ref!r}: Ollama has no such model here ({manifest} not found; `ollama list` "
                        f"shows what is pulled)", field="model")
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise UserError(f"model {ref!r}: Ollama's manifest {manifest} names no model layer", field="model") from None
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise UserError(f"model {ref!r}: Ollama's blob {blob} is missing (pull the model again)", field="model")
    return blob


def gguf_path(name: str) -> Path:
    """The GGUF file a ``--model`` value names (a path, or an Ollama model), checked to be a whole GGUF."""
    path = ollama_blob(name) if name.startswith(OLLAMA_PREFIX) else Path(name).expanduser()
    if not path.exists():
        raise UserError(f"model {name!r}: no such file", field="model")
    return read_gguf_info(path).path


def fingerprint(path: Path, samples: int = 32, chunk: int = 1 << 16) -> str:
    """Size plus ``samples`` chunks spread over the file: cheap for a 10 GB GGUF, distinct per model."""
    size = path.stat().st_size
    h = hashlib.blake2b(str(size).encode(), digest_size=8)
    with path.open("rb") as f:
        for i in range(samples):
            f.seek(i * max(size - chunk, 0) // max(samples - 1, 1))
            h.update(f.read(chunk))
    return h.hexdigest()


def _cache_dir(path: Path) -> Path:
    return cache_root() / fingerprint(path)  # by content: the same file under another name or in Ollama's store


def converted_dir(name: str) -> Path | None:
    """The cached model directory of a GGUF source, or None while it has not been converted."""
    out = _cache_dir(gguf_path(name))
    return out if (out / "config.json").is_file() else None


def model_dir(name: str, log=print) -> Path:
    """A Hugging Face model directory holding the GGUF's weights and tokenizer (converted once, cached)."""
    path = gguf_path(name)
    out = _cache_dir(path)
    if (out / "config.json").is_file():
        return out
    log(f"converting {path} to a Hugging Face model directory (once; cached in {out})")
    with atomic_dir(out) as tmp:
        _convert(path, tmp, log)
        (tmp / "localrl-source.txt").write_text(f"converted from {path} ({name})\n")
    return out


def _convert(path: Path, out: Path, log) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": path.name}
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    except (ValueError, KeyError, OSError, RuntimeError) as e:  # an architecture transformers cannot read
        raise UserError(f"model {path}: transformers cannot read this GGUF ({first_line(e)})", field="model") \
            from None
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the model below is a plain one: nothing to dequantise on load
    dtype = torch.bfloat16 if sum(p.numel() for p in model.parameters()) > 2e9 else torch.float32
    state = model.state_dict()
    del model
    for name in state:  # cast tensor by tensor, each float32 original freed as it goes
        state[name] = state[name].to(dtype)
    with torch.device("meta"):  # a plain model made of the loaded tensors themselves: no second copy (which
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)  # took SmolLM2's peak from 1.12 to 1.48 GiB)
    plain.load_state_dict(state, assign=True)
    plain.tie_weights()
    del state
    plain.generation_config.eos_token_id = tok.eos_token_id
    plain.save_pretrained(out)
    del plain
    _fix_pre_tokenizer(tok, read_gguf_pre(path))
    tok.save_pretrained(out)
    _check_tokenizer(path, tok, log)


def read_gguf_pre(path: Path) -> str | None:
    pre = read_header(path).fields.get("tokenizer.ggml.pre")
    return str(pre) if pre is not None else None


def _fix_pre_tokenizer(tok, pre: str | None) -> None:
    """Give a byte-level BPE tokenizer the split llama.cpp runs for ``pre``."""
    from localrl.quant.pretokenizers import hf_pre_tokenizer

    backend = getattr(tok, "backend_tokenizer", None)
    replacement = hf_pre_tokenizer(pre) if pre else None
    if backend is None or replacement is None or json.loads(backend.to_str())["model"]["type"] != "BPE":
        return
    backend.pre_tokenizer = replacement


def _check_tokenizer(path: Path, tok, log) -> None:
    """Compare the converted tokenizer with llama.cpp's tokenisation of the original file, where possible."""
    from localrl.quant.pretokenizers import PROBES, hf_ids, llama_cpp_ids

    try:
        theirs = llama_cpp_ids(path, PROBES)
    except UserError:
        log("llama.cpp is not installed: the converted tokenizer was not checked against the original file")
        return
    differ = [text for text, ids in zip(PROBES, theirs) if hf_ids(tok, text) != ids]
    if differ:
        log(f"warning: the converted tokenizer splits {len(differ)} of {len(PROBES)} probe texts differently "
            f"from llama.cpp on the original file (first: {differ[0][:30]!r})")
