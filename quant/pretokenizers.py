"""llama.cpp's BPE pre-tokenizers: their names, their split rules, and choosing one by behaviour.

A GGUF names its pre-tokenizer (``tokenizer.ggml.pre``); llama.cpp then splits text with that
name's regular expressions, one after the other, before the merges run. Two consequences:

- Reading a GGUF: transformers' conversion keeps only a GPT-2-style split and drops, for
  example, smollm's one-digit-at-a-time split, so the tokenizer is rebuilt from the split
  rules below (``hf_pre_tokenizer``).
- Writing a GGUF: the name must make llama.cpp split as the Hugging Face tokenizer does.
  llama.cpp's converter picks it from a hash table of known tokenizers; localrl picks it by
  behaviour instead (``choose_pre_tokenizer``): the name whose llama.cpp tokenisation equals
  the tokenizer's on probe texts (digit and whitespace runs, punctuation, code, several
  scripts), and refuses with one line when none does.

The split rules are llama.cpp's (llama-vocab.cpp), for the names that small open models use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from localrl.errors import UserError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS: dict[str, list[str]] = {  # name -> llama.cpp's regular expressions, applied in order
    "gpt-2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "llama-bpe": [_LLAMA3],
    "qwen2": [_QWEN2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
}

PROBES = [
    "1234567890 3.14159 1,000,000 x2 42nd 2024-11-30",
    "  42 apples\nx   123\n1  2  3\t\t7",
    "Hello, world!!! (a+b)*c=d; it's we'll they're ... <>&^~|`",
    "   leading and trailing   ",
    "line one\n\n\nline two\r\nend\n",
    "def f(x):\n    return x**2  # square\n\tpass",
    "中文测试：你好，世界。日本語のテキストです。한국어 문장입니다.",
    "Привет, мир! Ёжик. مرحبا بالعالم. नमस्ते दुनिया. Γειά σου.",
    "café naïve ñandú Æsir ÀÉÎÕÜ",
    "🙂👍🏽 emoji 🚀! ALLCAPS CamelCase snake_case kebab-case",
]


def hf_pre_tokenizer(name: str):
    """The tokenizers-library pre-tokenizer that splits as llama.cpp's ``name`` does (byte-level BPE),
    or None for a name this table lacks."""
    from tokenizers import Regex, pre_tokenizers

    if name not in SPLITS:
        return None
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in SPLITS[name]]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def hf_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def llama_cpp_ids(gguf_path: Path, texts: list[str]) -> list[list[int]]:
    """How llama.cpp tokenizes ``texts`` with the vocabulary of the GGUF at ``gguf_path`` (no weights read,
    no context made: llama.cpp's own vocabulary-only load and tokenizer)."""
    from localrl.quant.runtime import quiet, require_llama_cpp

    llama_cpp = require_llama_cpp("checking a tokenizer against llama.cpp")
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with quiet():
        model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), params)
    if not model:
        raise UserError(f"llama.cpp cannot read the vocabulary of {gguf_path}")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        out = []
        for text in texts:
            data = text.encode()
            buf = (llama_cpp.llama_token * (len(data) + 8))()  # never more tokens than bytes
            n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
            out.append(list(buf[:n]))
        return out
    finally:
        llama_cpp.llama_model_free(model)


def choose_pre_tokenizer(tok, first_guess: str, write_vocab: Callable[[str, Path], None], workdir: Path) -> str:
    """The llama.cpp pre-tokenizer name under which llama.cpp tokenizes the probes as ``tok`` does.

    ``write_vocab(name, path)`` writes a vocabulary-only GGUF naming ``name``; ``first_guess`` (from
    the tokenizer's own split pattern) is tried first, then every other known name.
    """
    want = [hf_ids(tok, t) for t in PROBES]
    tried = []
    for name in [first_guess, *(n for n in SPLITS if n != first_guess)]:
        path = workdir / f"vocab-{name}.gguf"
        write_vocab(name, path)
        try:
            got = llama_cpp_ids(path, PROBES)
        except UserError:  # a name this llama.cpp build does not know
            tried.append(f"{name} (not known to this llama.cpp)")
            continue
        finally:
            path.unlink(missing_ok=True)
        if got == want:
            return name
        first_diff = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        tried.append(f"{name} (differs on {PROBES[first_diff][:20]!r})")
    raise UserError("export: no pre-tokenizer llama.cpp knows splits text as this tokenizer does; tried "
                    + ", ".join(tried))
