"""Read a GGUF file's header before llama.cpp gets it: is it a complete GGUF, which architecture,
and which context length it was trained for.

llama.cpp reports a damaged file deep inside its loader (or crashes); reading the header
with gguf-py first turns a wrong, truncated or foreign file into one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localrl.errors import UserError


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str
    context_length: int | None  # the training context (``{arch}.context_length``), if the file says
    sizes: dict  # Hugging Face config names -> values, for the memory planner (read from the header)
    name: str = ""  # general.name: localrl writes the model's source (a built-in's directory, say)


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """The header of the GGUF at ``path``; UserError if it is missing, not a GGUF, or truncated."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"model {p}: " + ("is a directory, not a .gguf file" if p.is_dir() else "no such file"))
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise UserError(f"model {p}: cannot be read ({e.strerror})") from None
    if magic != b"GGUF":
        raise UserError(f"model {p}: not a GGUF file")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(p)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        arch = str(reader.fields["general.architecture"].contents())
        ctx_field = reader.fields.get(f"{arch}.context_length")
        sizes = _sizes(reader, arch)
        name_field = reader.fields.get("general.name")
        name = str(name_field.contents()) if name_field is not None else ""
    except Exception as e:  # gguf-py raises several kinds on damaged headers
        raise UserError(f"model {p}: damaged or truncated GGUF ({_first_line(e)})") from None
    if end > p.stat().st_size:
        raise UserError(f"model {p}: truncated GGUF ({p.stat().st_size} bytes, its tensors need {end})")
    return GGUFInfo(p, arch, int(ctx_field.contents()) if ctx_field is not None else None, sizes, name)


def _sizes(reader, arch: str) -> dict:
    """The model's sizes under their config.json names (absent keys are left out)."""
    def get(key):
        field = reader.fields.get(f"{arch}.{key}")
        return int(field.contents()) if field is not None else None

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    sizes = {"hidden_size": get("embedding_length"), "num_hidden_layers": get("block_count"),
             "num_attention_heads": get("attention.head_count"),
             "num_key_value_heads": get("attention.head_count_kv"), "head_dim": get("attention.key_length"),
             "intermediate_size": get("feed_forward_length"),
             "vocab_size": get("vocab_size") or (len(tokens.data) if tokens is not None else None),
             "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}
    return {k: v for k, v in sizes.items() if v is not None}


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
