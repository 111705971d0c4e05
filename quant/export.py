"""``localrl export``: a run's adapter merged onto its full-precision base, or a model directory, to GGUF.

The adapter is merged onto the base weights as stored (float32 on load), never onto a
dequantized 4-bit copy, which would carry the 4-bit rounding into every exported weight.
f32, f16 and bf16 are written by gguf-py; every quantised type is llama.cpp's own quantisation
of an f16 file written first, which is validated (strictly) before it is quantised.

The output is checked before any weights load (a writable directory, not an existing
folder), written under a hidden temporary name, validated in llama.cpp, and only then
renamed into place with its Modelfile: a file under the requested name has passed
validation (or was asked for with ``check=False``). A file that fails validation is not
kept. Temporary files a killed export left are removed on the next export to that name.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from localrl.errors import UserError, out_of_space
from localrl.memory import ModelShape, check_export, reset_resident_peak, resident_bytes
from localrl.quant.gguf_check import CheckReport, TorchReference, check_gguf
from localrl.quant.gguf_writer import (LLAMA_CPP_TYPES, check_architecture, llama_cpp_quantize, pre_tokenizer_guess,
                                       vocab_kind, write_gguf)
from localrl.quant.modelfile import modelfile_path, write_modelfile
from localrl.quant.pretokenizers import choose_pre_tokenizer
from localrl.quant.runtime import require_llama_cpp


@dataclass
class ExportResult:
    path: Path | None  # None when validation failed and nothing was written
    source: str  # which weights were written, in words
    report: CheckReport | None
    modelfile: Path | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # each phase's wall time, in the order they ran
    peaks: dict[str, int] = field(default_factory=dict)  # each phase's resident peak, bytes (where /proc tells)


DIRECT_TYPES = ("f32", "f16", "bf16")  # written by gguf-py; the rest by llama.cpp's quantizer
EXPORT_TYPES = (*DIRECT_TYPES, *LLAMA_CPP_TYPES)


def check_exportable(config, tok) -> None:
    """Stop (one line) unless the architecture and vocabulary can be written to GGUF."""
    check_architecture(config)
    vocab_kind(tok)


def check_output(out: str | Path, quant: str) -> Path:
    """The output path, checked before any weights load: a known type, a .gguf name, a writable directory."""
    if quant not in EXPORT_TYPES:
        raise UserError(f"export: unknown quant type {quant!r}; use one of {', '.join(EXPORT_TYPES)}")
    out = Path(out)
    if out.suffix != ".gguf":
        raise UserError(f"export: output {out} should end in .gguf")
    if out.is_dir():
        raise UserError(f"export: output {out} is a directory")
    blocked = next((a for a in out.parents if a.exists() and not a.is_dir()), None)
    if blocked is not None:
        raise UserError(f"export: cannot write {out} ({blocked} is a file, not a directory)")
    made = [a for a in out.parents if not a.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.with_name(f".tmp-probe-{uuid.uuid4().hex[:8]}")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        for a in made:  # innermost first: leave no empty folders behind
            try:
                a.rmdir()
            except OSError:
                pass
        raise UserError(f"export: cannot write {out} ({e.strerror or e})") from None
    return out


def pre_tokenizer(config, tok, tok_dir: Path, log=print) -> str | None:
    """The llama.cpp pre-tokenizer name for a byte-level BPE vocabulary, chosen by behaviour where
    llama.cpp is installed (None: the writer's guess from the split pattern, or no pre-tokenizer)."""
    if vocab_kind(tok) != "gpt2":
        return None
    guess = pre_tokenizer_guess(tok)
    try:
        require_llama_cpp("")
    except UserError:
        log(f"pre-tokenizer {guess!r} recognised from the split pattern (llama.cpp is not installed to confirm it)")
        return guess
    with tempfile.TemporaryDirectory() as tmp:
        name = choose_pre_tokenizer(tok, guess, lambda n, p: write_gguf({}, config, tok_dir, tok, p, "f32", n),
                                    Path(tmp))
    if name != guess:
        log(f"pre-tokenizer {name!r}: llama.cpp splits text as the tokenizer does only under this name "
            f"(the split pattern suggested {guess!r})")
    return name


class Phases:
    """Wall time and resident peak of each phase of an export, and a log line as each starts (an export takes
    seconds to minutes)."""

    def __init__(self, log=print):
        self.log, self.t0, self.seconds, self.peaks = log, time.monotonic(), {}, {}
        self.current, self.since = None, self.t0

    def start(self, phase: str | None, text: str | None = None) -> None:
        now = time.monotonic()
        if self.current is not None:
            self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self.since
            peak = resident_bytes("VmHWM")
            if peak is not None:
                self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak)
        reset_resident_peak()
        self.current, self.since = phase, now
        if text:
            self.log(f"[{now - self.t0:4.0f} s] {text}")

    def stop(self) -> tuple[dict[str, float], dict[str, int]]:
        self.start(None)
        return self.seconds, self.peaks


def remove_leftovers(out: Path) -> None:
    """Delete the temporary files of earlier exports to ``out`` that were killed midway."""
    names = (out.name, modelfile_path(out).name)
    for stale in out.parent.glob(".tmp-*"):
        if stale.name.endswith(names) and stale.is_file():
            stale.unlink(missing_ok=True)


def export(source: str | Path, out: str | Path, quant: str = "f16", check: bool = True, log=print) -> ExportResult:
    from localrl.runs import is_run, load_merged

    out = check_output(out, quant)
    if check or quant in LLAMA_CPP_TYPES:  # before any weights load
        require_llama_cpp("validating a GGUF (--no-check skips it)" if check else f"export to {quant}")
    remove_leftovers(out)
    phases = Phases(log)

    def result(path, report, modelfile=None) -> ExportResult:
        return ExportResult(path, what, report, modelfile, *phases.stop())

    def before_loading(config, tok) -> None:  # the architecture, vocabulary and memory, before weights load
        check_exportable(config, tok)
        check_export(ModelShape.from_config(config), "export")

    phases.start("load", f"loading {source}" + (" and merging its adapter" if is_run(source) else ""))
    model, tok, tok_dir, what = load_merged(source, check=before_loading)
    log(f"exporting {what}")
    phases.start("write")  # choosing the pre-tokenizer writes vocabulary-only files
    pre = pre_tokenizer(model.config, tok, tok_dir, log)
    params = sum(p.numel() for p in model.parameters())
    tmp = out.with_name(f".tmp-{uuid.uuid4().hex[:8]}-{out.name}")
    report = None
    reference = TorchReference(model, tok) if check else None  # the f16 file's check and the quantised one's
    try:
        if quant in LLAMA_CPP_TYPES:  # llama.cpp's quantizer, from an f16 file written (and checked) first
            f16 = out.with_name(f".tmp-f16-{uuid.uuid4().hex[:8]}-{out.name}")
            try:
                phases.start("write", f"writing an f16 GGUF ({params / 1e6:.1f}M parameters)")
                write_gguf(model.state_dict(), model.config, tok_dir, tok, f16, "f16", pre)
                if check:  # the writer's own errors show at f16, before quantisation blurs them
                    phases.start("validate f16", "validating the f16 file in llama.cpp (tokenizer and logits "
                                                 "against torch)")
                    f16_report = check_gguf(f16, reference, "f16")
                    if not f16_report.passed:
                        log(f"not written: the f16 file that {quant} is quantised from failed validation "
                            f"in llama.cpp")
                        return result(None, f16_report)
                phases.start("quantise", f"quantising to {quant} (llama.cpp)")
                llama_cpp_quantize(f16, tmp, quant, log)
            finally:
                f16.unlink(missing_ok=True)
        else:
            phases.start("write", f"writing a {quant} GGUF ({params / 1e6:.1f}M parameters)")
            write_gguf(model.state_dict(), model.config, tok_dir, tok, tmp, quant, pre)
        if check:
            phases.start("validate", f"validating the {quant} file in llama.cpp (tokenizer and logits against torch)")
        report = check_gguf(tmp, reference, quant) if check else None
        if report is not None and not report.passed:
            log(f"not written: {out} failed validation in llama.cpp (--no-check writes it anyway)")
            return result(None, report)
        modelfile = write_modelfile(out, tok, model.config.max_position_embeddings)  # first: a GGUF in place
        tmp.replace(out)                                                              # always has its Modelfile
    except Exception as e:  # noqa: BLE001 - a full disk is one line; anything else keeps its traceback
        if not out_of_space(e):
            raise
        raise UserError(f"export: no space left writing {out} ({shutil.disk_usage(out.parent).free / 2**20:.1f} MB "
                        f"free there); nothing was left behind") from None
    finally:
        tmp.unlink(missing_ok=True)
    log(f"wrote {out} ({quant}, {out.stat().st_size / 2**20:.1f} MiB"
        + (", validated in llama.cpp)" if check else ", not validated)"))
    log(f"wrote {modelfile} (ollama create NAME -f {modelfile})" if modelfile else
        "no Ollama Modelfile: the chat template is neither ChatML nor Llama 3")
    return result(out, report, modelfile)
