"""Read a GGUF file's header before llama.cpp gets it: is it a complete GGUF, which architecture,
and which context length it was trained for.

llama.cpp reports a damaged file deep inside its loader (or crashes); reading the header
first turns a wrong, truncated or foreign file into one line naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from localrl.errors import UserError, first_line


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
    try:
        header = read_header(p)
        arch = str(header.fields["general.architecture"])
    except Exception as e:  # struct, unicode and key errors on damaged headers
        raise UserError(f"model {p}: damaged or truncated GGUF ({first_line(e)})") from None
    size = p.stat().st_size
    if header.end > size:
        raise UserError(f"model {p}: truncated GGUF ({size} bytes, its tensors need {header.end})")
    context = header.fields.get(f"{arch}.context_length")
    return GGUFInfo(p, arch, int(context) if context is not None else None, _sizes(header, arch),
                    str(header.fields.get("general.name", "")))


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF's key-value pairs and tensor table as the file states them. Arrays (the vocabulary, the merges) are
    stepped over, their lengths kept: gguf-py's reader builds a numpy view per element, seconds for a vocabulary
    of 50-150k tokens, and the header is read on every start."""

    fields: dict  # key -> scalar value (int, float, bool or str)
    array_lengths: dict  # key -> number of elements
    tensors: dict  # name -> (shape as stored, ggml type id, first byte in the file, size in bytes)

    @property
    def end(self) -> int:
        """The byte after the last tensor's data: the least size of a whole file."""
        return max((first + n for _, _, first, n in self.tensors.values()), default=0)


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file at ``path`` (versions 2 and 3, either byte order), from its bytes alone; raises
    ValueError or struct.error on a damaged or truncated header."""
    import mmap
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
        version = struct.unpack_from(order + "I", buf, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        pos = 8

        def take(fmt: str) -> tuple:
            nonlocal pos
            values = struct.unpack_from(order + fmt, buf, pos)
            pos += struct.calcsize(order + fmt)
            return values

        def string() -> str:
            nonlocal pos
            (n,) = take("Q")
            if pos + n > len(buf):
                raise ValueError("a string runs past the end of the file")
            pos += n
            return buf[pos - n:pos].decode("utf-8")

        def skip_array(item: int, n: int) -> None:
            nonlocal pos
            if item == _STRING:
                length = struct.Struct(order + "Q")
                for _ in range(n):
                    pos += 8 + length.unpack_from(buf, pos)[0]
            elif item in _SCALARS:
                pos += n * struct.calcsize(order + _SCALARS[item])
            else:
                raise ValueError(f"an array of value type {item}")

        tensor_count, kv_count = take("QQ")
        fields, arrays = {}, {}
        for _ in range(kv_count):
            key = string()
            (kind,) = take("I")
            if kind == _ARRAY:
                item, arrays[key] = take("IQ")
                skip_array(item, arrays[key])
            elif kind == _STRING:
                fields[key] = string()
            elif kind in _SCALARS:
                fields[key] = take(_SCALARS[kind])[0]
            else:
                raise ValueError(f"{key} has value type {kind}")
        table = []
        for _ in range(tensor_count):
            name = string()
            (n_dims,) = take("I")
            dims = take(f"{n_dims}Q")
            kind, offset = take("IQ")
            table.append((name, dims, kind, offset))
        if pos > len(buf):
            raise ValueError("the tensor table runs past the end of the file")
    alignment = fields.get("general.alignment", 32)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    data = pos + (-pos % alignment)
    tensors = {}
    for name, dims, kind, offset in table:
        if name in tensors:
            raise ValueError(f"tensor {name} appears twice")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        tensors[name] = (dims, kind, data + offset, math.prod(dims) * type_size // block)
    return GGUFHeader(fields, arrays, tensors)


def _sizes(header: GGUFHeader, arch: str) -> dict:
    """The model's sizes under their config.json names (absent keys are left out)."""
    def get(key):
        value = header.fields.get(f"{arch}.{key}")
        return int(value) if value is not None else None

    sizes = {"hidden_size": get("embedding_length"), "num_hidden_layers": get("block_count"),
             "num_attention_heads": get("attention.head_count"),
             "num_key_value_heads": get("attention.head_count_kv"), "head_dim": get("attention.key_length"),
             "intermediate_size": get("feed_forward_length"),
             "vocab_size": get("vocab_size") or header.array_lengths.get("tokenizer.ggml.tokens"),
             "tie_word_embeddings": "output.weight" not in header.tensors,
             "max_position_embeddings": get("context_length")}
    return {k: v for k, v in sizes.items() if v is not None}
