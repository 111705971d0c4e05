"""An Ollama Modelfile beside each GGUF: FROM, a Go TEMPLATE for the chat format, stops and context size.

Without a TEMPLATE Ollama guesses from the GGUF's Jinja template and falls back to a bare
``{{ .Prompt }}`` for formats it does not know (Qwen's ChatML among them), and without stop
parameters a fine-tune may never stop. The chat format is recognised from the Jinja
template's turn markers: ChatML (Qwen, the built-in model) and Llama 3 headers. A template that
adds a system turn of its own when none is given (SmolLM2's "You are a helpful AI assistant
named SmolLM...") has it kept as the Modelfile's SYSTEM, which Ollama sends in its place.
"""

from __future__ import annotations

import re
from pathlib import Path

from localrl.atomic import write_text_atomic

# .Messages carries system messages too (Role "system"), so .System is not written separately.
CHATML = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
    "<|im_start|>assistant\n"
)
LLAMA3 = (
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
FORMATS = {"<|im_start|>": (CHATML, ["<|im_end|>"]), "<|start_header_id|>": (LLAMA3, ["<|eot_id|>"])}
_SYSTEM_TURN = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>|"
                          r"<\|start_header_id\|>system<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.DOTALL)


def default_system(tok) -> str | None:
    """The system message the chat template adds when a conversation brings none, if it adds one."""
    if not tok.chat_template:
        return None
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True)
    except Exception:  # a template that needs other variables: no default to read off
        return None
    found = _SYSTEM_TURN.search(text)
    return next((g for g in found.groups() if g), None) if found else None


def modelfile_text(gguf_name: str, chat_template: str | None, eos_token: str | None,
                   context_length: int, system: str | None = None) -> str | None:
    """The Modelfile for ``gguf_name`` (a path relative to the Modelfile); None for an unknown chat format."""
    for marker, (template, stops) in FORMATS.items():
        if chat_template and marker in chat_template:
            break
    else:
        return None
    stops = stops + ([eos_token] if eos_token and eos_token not in stops else [])
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    if system:
        lines.append(f'SYSTEM """{system}"""')
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    lines.append(f"PARAMETER num_ctx {min(context_length, 4096)}")
    return "\n".join(lines) + "\n"


def modelfile_path(gguf_path: Path) -> Path:
    return gguf_path.with_suffix(".Modelfile")


def write_modelfile(gguf_path: Path, tok, context_length: int) -> Path | None:
    """Write ``NAME.Modelfile`` beside ``NAME.gguf`` (atomically); None if the chat format is unknown."""
    text = modelfile_text(gguf_path.name, tok.chat_template, tok.eos_token, context_length, default_system(tok))
    if text is None:
        return None
    path = modelfile_path(gguf_path)
    write_text_atomic(path, text)
    return path
