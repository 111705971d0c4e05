"""The last step of an export: ``localrl export ... --ollama NAME`` makes the GGUF an Ollama model and checks that
Ollama runs it as llama.cpp does.

With the ``ollama`` binary on PATH: ``ollama create NAME -f FILE.Modelfile`` (the Modelfile export wrote beside the
GGUF: its chat TEMPLATE, stops, context), then ``ollama show NAME``, then one greedy request through Ollama's
OpenAI-compatible endpoint (``OLLAMA_HOST``, default 127.0.0.1:11434) compared with llama.cpp's greedy reply to the
same request on the same GGUF (its own chat template). The two prompts are the same only if the Modelfile's Go
TEMPLATE renders the conversation as the GGUF's Jinja template does, so equal replies check the template too.
Without the binary: one line naming the Modelfile to give ``ollama create`` later. Every failure is one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from localrl.errors import UserError

CHECK_MESSAGES = [{"role": "user", "content": "What is 457 + 68?"}]
CHECK_TOKENS = 24  # a short reply: long enough to tell two prompts apart, short of repetition penalties
DEFAULT_HOST = "127.0.0.1:11434"
# Ollama's model names: [host/][namespace/]model[:tag], each part letters, digits, '.', '_' and '-'
_NAME = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/){0,2}[A-Za-z0-9][A-Za-z0-9._-]*(?::[A-Za-z0-9_][A-Za-z0-9._-]*)?$")


def check_name(name: str) -> None:
    """One line for a name Ollama would refuse, before any export work."""
    if not _NAME.match(name) or len(name) > 350:
        raise UserError(f"export --ollama {name!r}: not an Ollama model name ([namespace/]model[:tag]; letters, "
                        f"digits, '.', '_' and '-')")


@dataclass
class OllamaResult:
    created: bool  # `ollama create` made the model
    reply: str = ""  # Ollama's greedy reply to the check request
    expected: str = ""  # llama.cpp's
    note: str = ""  # what happened, in one line

    @property
    def same(self) -> bool:
        return self.created and self.reply == self.expected


def ollama_host() -> str:
    """Ollama's base URL, as its own client finds it (``OLLAMA_HOST``: host[:port] or a URL)."""
    host = os.environ.get("OLLAMA_HOST", "").strip() or DEFAULT_HOST
    if "://" not in host:
        host = "http://" + host
    if not re.search(r":\d+$", host.split("://", 1)[1]):
        host += ":11434"
    return host.rstrip("/")


def publish(gguf: Path, modelfile: Path | None, name: str, log=print) -> OllamaResult:
    """Create ``name`` in Ollama from ``modelfile`` and check one greedy reply against llama.cpp's."""
    if modelfile is None:
        raise UserError(f"export --ollama {name}: no Modelfile was written (the chat template is neither ChatML "
                        f"nor Llama 3), so Ollama would not know the chat format of {gguf}")
    binary = shutil.which("ollama")
    if binary is None:
        note = f"ollama: not installed here; later, run: ollama create {name} -f {modelfile}"
        log(note)
        return OllamaResult(False, note=note)
    _run([binary, "create", name, "-f", str(modelfile)], modelfile.parent, f"ollama create {name}")
    log(f"ollama: created {name} from {modelfile}")
    _run([binary, "show", name], modelfile.parent, f"ollama show {name}")
    reply = _ollama_reply(name)
    expected = llama_cpp_reply(gguf)
    result = OllamaResult(True, reply, expected)
    if result.same:
        result.note = f"ollama: {name} answers as llama.cpp does ({len(reply)} characters, greedy): {reply[:60]!r}"
    else:
        at = next((i for i, (a, b) in enumerate(zip(reply, expected)) if a != b), min(len(reply), len(expected)))
        result.note = (f"ollama: {name}'s greedy reply differs from llama.cpp's at character {at}: ollama "
                       f"{reply[:80]!r}, llama.cpp {expected[:80]!r}")
    log(result.note)
    return result


def llama_cpp_reply(gguf: Path, messages: list[dict] = CHECK_MESSAGES, max_tokens: int = CHECK_TOKENS) -> str:
    """llama.cpp's greedy reply to ``messages`` on ``gguf``, formatted by the GGUF's own chat template."""
    from localrl.serving.chat import GGUFChat

    chat = GGUFChat(gguf)
    try:
        return "".join(chat.stream(messages, max_tokens=max_tokens, temperature=0.0))
    finally:
        chat.close()


def _ollama_reply(name: str, messages: list[dict] = CHECK_MESSAGES, max_tokens: int = CHECK_TOKENS) -> str:
    base = ollama_host()
    body = json.dumps({"model": name, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                       "seed": 0, "stream": False}).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            payload = json.loads(response.read())
        return payload["choices"][0]["message"]["content"] or ""
    except urllib.error.HTTPError as e:
        raise UserError(f"ollama: {base}/v1/chat/completions answered {e.code} for {name}: "
                        f"{' '.join(e.read().decode('utf-8', 'replace').split())[:200]}") from None
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"ollama: its server does not answer at {base} ({getattr(e, 'reason', e)}); start it with "
                        f"`ollama serve` (or set OLLAMA_HOST)") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise UserError(f"ollama: {base}/v1/chat/completions did not answer with a chat completion") from None


def _run(argv: list[str], cwd: Path, what: str) -> str:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise UserError(f"{what}: no answer within 600 s") from None
    if done.returncode != 0:
        said = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise UserError(f"{what} failed (exit {done.returncode}): {said[-1].strip() if said else 'it said nothing'}")
    return done.stdout
