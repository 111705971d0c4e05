"""Write a Llama / Mistral / Qwen2 / Qwen3 model to GGUF with gguf-py: offline, no llama.cpp checkout.

What llama.cpp expects, and what this writes:
- tensor names from gguf-py's name map; 1-D tensors (norms, biases) stay F32; 2-D weights
  take the requested type, falling back to F16 where a row does not divide into blocks;
- Llama and Mistral q/k projections permuted to the rotary layout llama.cpp uses (its
  converter does the same); Qwen2/Qwen3 use NEOX rotary and stay as they are; Qwen3 adds
  the q/k norms;
- tied embeddings: no ``output.weight``, llama.cpp reuses ``token_embd``;
- the vocabulary as llama.cpp tokenizes it: GPT-2-style byte-level BPE (tokens, token types,
  merges, a pre-tokenizer name llama.cpp knows) or SentencePiece-style BPE with byte fallback
  (tokens, scores ranked like the merges, byte and unknown token types, the space prefix);
  the bos/eos/pad/end-of-turn ids, whether bos/eos are added, and the chat template.

- rope scaling: linear and YaRN as scaling keys, Llama 3 as a ``rope_freqs`` tensor.

The file is written under a temporary name and renamed when complete.

Deliberate limits: BPE vocabularies only (no Unigram or WordPiece); other rope scalings
(dynamic, longrope...) are refused rather than written half right.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from localrl.errors import UserError

ARCHITECTURES = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
QUANT_TYPES = {  # name -> (tensor type, file type)
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
}
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "mscale": None,
                 "mscale_all_dim": None, "truncate": True}
# Types llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize) writes from an f16 file;
# name -> llama_ftype. gguf-py only dequantizes K-quants, and its q8_0..q5_1 differ from llama.cpp's in
# rounding: export quantizes every one of these through llama.cpp, so a user gets llama.cpp's bytes.
LLAMA_CPP_TYPES = {"q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13, "q4_k_s": 14, "q4_k_m": 15,
                 "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18}
# Pre-tokenizer names llama.cpp knows, recognised from the split pattern in tokenizer.json.
_PRE_BY_PATTERN = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
}


# llama.cpp's log line for a tensor whose rows do not divide into the type's blocks (one a tensor, at error level)
_FALLBACK = re.compile(r"^warning: (\S+)\s+- ncols\s+\d+ not divisible by \d+ \(required for type\s+(\S+)\) "
                       r"-> falling back to\s+(\S+)\s*$")
_FALLBACK_COUNT = re.compile(r"^\S+: WARNING: \d+ of \d+ tensor\(s\) required fallback quantization\s*$")
_ERROR, _CONTINUED = 3, 5  # ggml's log levels


def llama_cpp_quantize(src: Path, out: Path, quant: str, log=print) -> Path:
    """Quantize the GGUF ``src`` to ``quant`` (a LLAMA_CPP_TYPES name) at ``out`` (atomically) with llama.cpp. The
    line llama.cpp logs for each tensor that fell back to another type is said once instead, in one line (``log``):
    the types it fell back to, for how many tensors; its other errors are shown as llama-cpp-python shows them."""
    import ctypes

    from localrl.quant.runtime import require_llama_cpp

    llama_cpp = require_llama_cpp(f"export to {quant}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_CPP_TYPES[quant]
    params.nthread = os.cpu_count() or 1
    tmp = out.with_name(f".tmp-{out.name}")
    lines: list[list] = []  # [level, text] of each line llama.cpp logs (a line may come in several pieces)

    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, user_data) -> None:
        piece = text.decode("utf-8", "replace")
        if lines and (level == _CONTINUED or not lines[-1][1].endswith("\n")):
            lines[-1][1] += piece
        else:
            lines.append([level, piece])

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {src} to {quant}")
        os.replace(tmp, out)
    finally:
        from llama_cpp import _logger

        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))  # llama-cpp-python's, as it was
        tmp.unlink(missing_ok=True)
    fell_back: dict[str, list[str]] = {}
    for level, text in lines:
        found = _FALLBACK.match(text)
        if found:
            fell_back.setdefault(f"{found.group(2)} -> {found.group(3)}", []).append(found.group(1))
        elif level == _ERROR and not _FALLBACK_COUNT.match(text):
            print(text, end="", file=sys.stderr, flush=True)
    if fell_back:
        n = sum(map(len, fell_back.values()))
        log(f"note: {n} tensors' rows do not divide into {quant}'s blocks, so llama.cpp gave them another type: "
            + "; ".join(f"{kind} for {len(names)} ({_examples(names)})" for kind, names in fell_back.items()))
    return out


def _examples(names: list[str]) -> str:
    """A few tensor names, the layer number of the rest left out (``blk.*.attn_k.weight``)."""
    kinds = list(dict.fromkeys(re.sub(r"^blk\.\d+\.", "blk.*.", n) for n in names))
    return ", ".join(kinds[:4]) + (", ..." if len(kinds) > 4 else "")


def check_architecture(config) -> None:
    if config.model_type not in ARCHITECTURES:
        raise UserError(f"export: unsupported architecture {config.model_type!r}; "
                        f"supported: {', '.join(sorted(ARCHITECTURES))}")
    rope = _rope(config)
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise UserError(f"export: rope scaling {kind!r} is not supported yet (default, linear, llama3 and yarn are)")
    # llama.cpp reads no YaRN betas or attention factors for these architectures: only the defaults match.
    custom = {k: rope[k] for k, default in YARN_DEFAULTS.items() if rope.get(k, default) != default}
    if kind == "yarn" and custom:
        raise UserError(f"export: YaRN with {custom} is not supported (llama.cpp uses {YARN_DEFAULTS} for "
                        f"{config.model_type})")


def _rope(config) -> dict:
    """The config's rotary settings (transformers 5 keeps them in ``rope_parameters``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "type" in params and "rope_type" not in params:
        params = {**params, "rope_type": params["type"]}
    return params


def llama3_rope_factors(params: dict, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3 rope scaling, as llama.cpp reads them from ``rope_freqs``."""
    base, factor = params.get("rope_theta", 10000.0), params["factor"]
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old_len = params.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, mid))
    return out.astype(np.float32)


def _permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's half-split rotary layout to llama.cpp's interleaved one, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def pre_tokenizer_guess(tok) -> str:
    """The llama.cpp pre-tokenizer name recognised from the tokenizer's split pattern (a first guess,
    which export checks against llama.cpp's behaviour: quant/pretokenizers.py)."""
    from localrl.quant.pretokenizers import SPLITS, hf_pre_tokenizer

    pre = _tokenizer_json(tok).get("pre_tokenizer") or {}
    for name in SPLITS:  # a tokenizer imported from a GGUF carries llama.cpp's own rules (gguf_import.py)
        if pre == json.loads(hf_pre_tokenizer(name).__getstate__()):
            return name
    parts = pre.get("pretokenizers", [pre])
    for part in parts:
        pattern = (part.get("pattern") or {}).get("Regex")
        if pattern in _PRE_BY_PATTERN:
            return _PRE_BY_PATTERN[pattern]
    digits = any(p.get("type") == "Digits" and p.get("individual_digits") for p in parts)
    if any(p.get("type") == "ByteLevel" and p.get("use_regex", True) for p in parts):
        return "smollm" if digits else "gpt-2"
    return "default"


def _tokenizer_json(tok) -> dict:
    """The tokenizer as transformers runs it (its class may replace the file's pre-tokenizer:
    Qwen2's splits digits one by one, and llama.cpp must split text the same way)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise UserError("export: the tokenizer has no tokenizer.json form (a fast tokenizer); "
                        "only BPE vocabularies are supported")
    return json.loads(backend.to_str())


def _vocab_kind(tokenizer_json: dict) -> str:
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"export: {model.get('type')} tokenizers are not supported; only BPE vocabularies "
                        "(byte-level or SentencePiece-style with byte fallback) are")
    return "llama" if model.get("byte_fallback") else "gpt2"


def vocab_kind(tok) -> str:
    """The llama.cpp tokenizer model for ``tok``: "gpt2" (byte-level BPE, as in Llama 3 and Qwen)
    or "llama" (SentencePiece-style BPE with byte fallback, as in Llama 2 and Mistral)."""
    return _vocab_kind(_tokenizer_json(tok))


def _merge_pairs(tokenizer_json: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in tokenizer_json["model"]["merges"]]


def _spm_scores(tokens: list[str], tokenizer_json: dict) -> list[float]:
    """SentencePiece-style scores: llama.cpp merges the adjacent pair whose union scores highest,
    so a piece scores minus the rank of the first merge that makes it; pieces no merge makes
    (characters, bytes, specials) score below every merge."""
    pairs = _merge_pairs(tokenizer_json)
    rank: dict[str, int] = {}
    for r, (a, b) in enumerate(pairs):
        rank.setdefault(a + b, r)
    return [-float(rank.get(t, len(pairs))) for t in tokens]


def _adds_space_prefix(tokenizer_json: dict) -> bool:
    """Whether the tokenizer puts "▁" before the text (Metaspace, or Llama 2's Prepend normalizer)."""
    parts = []
    for key in ("normalizer", "pre_tokenizer"):
        part = tokenizer_json.get(key) or {}
        parts += part.get("normalizers", part.get("pretokenizers", [part]))
    return any((p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never")
               or (p.get("type") == "Prepend" and p.get("prepend") == "\u2581") for p in parts)


def _adds_specials(tok) -> tuple[bool, bool]:
    """(adds bos, adds eos) as the tokenizer behaves when asked to add special tokens."""
    ids = tok("a")["input_ids"]
    return (tok.bos_token_id is not None and ids[:1] == [tok.bos_token_id],
            tok.eos_token_id is not None and ids[-1:] == [tok.eos_token_id])


def _add_vocab(writer, tokenizer_dir: Path, tok, vocab_size: int, pre: str | None = None) -> None:
    import gguf

    tokenizer_json = _tokenizer_json(tok)
    kind = _vocab_kind(tokenizer_json)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:  # embedding rows beyond the tokenizer
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        if kind == "llama" and i == tok.unk_token_id:
            types[-1] = gguf.TokenType.UNKNOWN
        elif kind == "llama" and re.fullmatch(r"<0x[0-9A-F]{2}>", tokens[-1]):
            types[-1] = gguf.TokenType.BYTE
    writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if kind == "gpt2":
        writer.add_tokenizer_pre(pre or pre_tokenizer_guess(tok))
    else:
        writer.add_token_scores(_spm_scores(tokens, tokenizer_json))
        writer.add_add_space_prefix(_adds_space_prefix(tokenizer_json))
    special = gguf.SpecialVocab(str(tokenizer_dir), load_merges=kind == "gpt2", n_vocab=len(tokens))
    special.add_special_token = {}  # written below from how the tokenizer behaves, not its config
    special.add_to_gguf(writer, quiet=True)
    add_bos, add_eos = _adds_specials(tok)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    if tok.chat_template and "<|im_end|>" in tokens:  # ChatML: the end of a turn
        writer.add_eot_token_id(tokens.index("<|im_end|>"))


def _tensor_data(name: str, w: np.ndarray, qtype):
    """(data, raw dtype) for one tensor: 1-D in F32, others in ``qtype`` or F16 where rows do not fit blocks."""
    import gguf
    from gguf.quants import quantize

    if w.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32), gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if w.shape[-1] % block != 0:
        qtype = gguf.GGMLQuantizationType.F16
    return quantize(w.astype(np.float32), qtype), qtype


@contextmanager
def gguf_file(out: Path, arch) -> Iterator:
    """A ``gguf.GGUFWriter`` for ``out`` whose file appears there only once whole: written under a temporary
    name (header, key/values, tensors) when the block ends, then renamed; removed if anything fails."""
    import gguf

    tmp = out.with_name(f".tmp-{out.name}")
    # each tensor's data is spooled to a temporary file as it is added, not held until the end: the writer
    # holds one tensor's converted copy at a time instead of the whole file's (3 GB at 1.5B parameters, f16)
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch], use_temp_file=True)
    try:
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        if writer.temp_file is not None:
            writer.temp_file.close()
        tmp.unlink(missing_ok=True)
        raise


def write_gguf(state_dict: dict[str, torch.Tensor], config, tokenizer_dir: Path, tok, out: Path,
               quant: str = "f16", pre: str | None = None) -> Path:
    """Write ``state_dict`` (HF names, full precision) as GGUF at ``out`` (atomically). ``pre`` names
    the llama.cpp pre-tokenizer (default: recognised from the tokenizer's split pattern); an empty
    ``state_dict`` writes a vocabulary-only file, which llama.cpp can load with ``vocab_only``."""
    import gguf

    check_architecture(config)
    if quant not in QUANT_TYPES:
        raise UserError(f"export: unknown quant type {quant!r}; use one of {', '.join(QUANT_TYPES)}")
    tensor_type, file_type = QUANT_TYPES[quant]
    qtype = gguf.GGMLQuantizationType[tensor_type]
    arch = gguf.MODEL_ARCH[ARCHITECTURES[config.model_type]]
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head

    out.parent.mkdir(parents=True, exist_ok=True)
    with gguf_file(out, arch) as writer:
        writer.add_name(getattr(config, "_name_or_path", "") or out.stem)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_kv)
        writer.add_rope_freq_base(float(getattr(config, "rope_theta", None)
                                        or (config.rope_parameters or {}).get("rope_theta", 10000.0)))
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)
        if head_dim * n_head != config.hidden_size or config.model_type == "qwen3":
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        if arch == gguf.MODEL_ARCH.LLAMA:
            writer.add_rope_dimension_count(head_dim)
        rope = _rope(config)
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
        elif rope.get("rope_type") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(rope["factor"]))
            writer.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")
                                                     or config.max_position_embeddings))
        elif rope.get("rope_type") == "llama3":  # a per-frequency tensor, not scaling keys
            writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                              llama3_rope_factors(rope, head_dim))
        writer.add_file_type(gguf.LlamaFileType[file_type])
        _add_vocab(writer, Path(tokenizer_dir), tok, config.vocab_size, pre)

        names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        for hf_name, tensor in state_dict.items():
            if tied and hf_name == "lm_head.weight":
                continue
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise UserError(f"export: no GGUF name for tensor {hf_name!r}")
            w = tensor.detach().float().cpu().numpy()
            if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("q_proj.weight"):
                w = _permute_rotary(w, n_head)
            elif arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("k_proj.weight"):
                w = _permute_rotary(w, n_kv)
            data, dtype = _tensor_data(name, w, qtype)
            writer.add_tensor(name, data, raw_dtype=dtype)
    return out
