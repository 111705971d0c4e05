"""``localrl export``: a run's adapter merged onto its full-precision base, or a model directory, to GGUF.

The adapter is merged onto the base weights as stored (float32 on load), never onto a
dequantized 4-bit copy, which would carry the 4-bit rounding into every exported weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from localrl.errors import UserError
from quant.gguf_check import CheckReport, check_gguf
from quant.gguf_writer import (K_QUANT_TYPES, QUANT_TYPES, check_architecture, llama_cpp_quantize, vocab_kind,
                               write_gguf)
from quant.modelfile import write_modelfile


@dataclass
class ExportResult:
    path: Path
    source: str  # which weights were written, in words
    report: CheckReport | None


def check_exportable(config, tok) -> None:
    """Stop (one line) unless the architecture and vocabulary can be written to GGUF."""
    check_architecture(config)
    vocab_kind(tok)


def _checked_tokenizer(path: str, config, check: Callable | None):
    """The tokenizer, after ``check(config, tok)``: before any weights load."""
    from localrl.modeling import load_tokenizer

    try:
        tok = load_tokenizer(path)
    except (OSError, ValueError, ImportError) as e:
        raise UserError(f"model {path}: cannot load its tokenizer ({str(e).strip().splitlines()[0]})") from None
    if check is not None:
        check(config, tok)
    return tok


def load_merged(source: str | Path, check: Callable | None = check_exportable):
    """(merged full-precision model, tokenizer, tokenizer dir, description of the weights used);
    ``check(config, tok)`` runs first, so a model that cannot be used stops before its weights load."""
    from transformers import AutoModelForCausalLM

    from localrl.checkpoint import latest_checkpoint
    from localrl.modeling import load_config

    src = Path(source)
    if (src / "config.toml").is_file():  # a run directory
        from peft import PeftModel

        from localrl.trainer import resume_config

        cfg = resume_config(src)
        ckpt = latest_checkpoint(src)
        if ckpt is None:
            raise UserError(f"run {src}: the run has no adapter checkpoint")
        path, config = load_config(cfg.model)
        tok = _checked_tokenizer(path, config, check)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        try:
            model = PeftModel.from_pretrained(base, str(ckpt)).merge_and_unload()
        except Exception as e:  # a damaged adapter: one line, not a traceback
            raise UserError(f"run {src}: adapter {ckpt.name} cannot be loaded ({str(e).splitlines()[0]})") from None
        what = f"adapter {ckpt} merged onto the full-precision (float32) base {path}"
    else:
        path, config = load_config(str(source))
        tok = _checked_tokenizer(path, config, check)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        what = f"full-precision (float32) weights of {path}"
    return model.eval(), tok, Path(path), what


def export(source: str | Path, out: str | Path, quant: str = "f16", check: bool = True, log=print) -> ExportResult:
    if quant not in QUANT_TYPES and quant not in K_QUANT_TYPES:
        raise UserError(f"export: unknown quant type {quant!r}; use one of "
                        f"{', '.join([*QUANT_TYPES, *K_QUANT_TYPES])}")
    out = Path(out)
    if out.suffix != ".gguf":
        raise UserError(f"export: output {out} should end in .gguf")
    model, tok, tok_dir, what = load_merged(source)
    log(f"exporting {what}")
    if quant in K_QUANT_TYPES:  # llama.cpp's quantizer, from an f16 file written first
        f16 = out.with_name(f".tmp-f16-{out.name}")
        try:
            write_gguf(model.state_dict(), model.config, tok_dir, tok, f16, "f16")
            llama_cpp_quantize(f16, out, quant)
        finally:
            f16.unlink(missing_ok=True)
    else:
        write_gguf(model.state_dict(), model.config, tok_dir, tok, out, quant)
    log(f"wrote {out} ({quant}, {out.stat().st_size / 2**20:.1f} MiB)")
    modelfile = write_modelfile(out, tok, model.config.max_position_embeddings)
    log(f"wrote {modelfile} (ollama create NAME -f {modelfile})" if modelfile else
        "no Ollama Modelfile: the chat template is neither ChatML nor Llama 3")
    report = check_gguf(out, model, tok, quant) if check else None
    return ExportResult(out, what, report)
