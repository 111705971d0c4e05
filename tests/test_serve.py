"""A real llama-cpp-python server on a loopback port, serving a GGUF exported from the built-in model."""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from quant.export import export


@pytest.fixture(scope="module")
def tiny_gguf(builtin_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    export(builtin_model, out, "f16", check=False, log=lambda *_: None)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: bytes, key: str | None = None):
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def server(tiny_gguf):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "localrl.cli", "serve", str(tiny_gguf), "--port", str(port),
                             "--api-key", "sekrit", "--n-ctx", "256"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            request = urllib.request.Request(f"{base}/models", headers={"Authorization": "Bearer sekrit"})
            urllib.request.urlopen(request, timeout=2).read()
            break
        except OSError:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.3)
    yield base
    proc.terminate()
    proc.wait(timeout=20)


QUESTION = {"messages": [{"role": "user", "content": "What is 12 + 34?"}], "max_tokens": 60, "temperature": 0}


def test_chat_completion(server):
    status, text = _post(f"{server}/chat/completions", json.dumps(QUESTION).encode(), "sekrit")
    assert status == 200, text
    reply = json.loads(text)["choices"][0]["message"]["content"]
    assert reply.startswith("<think>") and "<answer>" in reply  # the model's format, through its chat template


def test_streaming_chat_completion(server):
    status, text = _post(f"{server}/chat/completions", json.dumps(QUESTION | {"stream": True}).encode(), "sekrit")
    assert status == 200
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 5
    streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    _, whole = _post(f"{server}/chat/completions", json.dumps(QUESTION).encode(), "sekrit")
    assert streamed == json.loads(whole)["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body", [b'{"messages": 5}', b'{"messages": [{"role":', b"[]"])
def test_malformed_request_gets_a_4xx_json_error(server, body):
    status, text = _post(f"{server}/chat/completions", body, "sekrit")
    assert 400 <= status < 500
    assert json.loads(text)["error"]["type"] == "invalid_request_error"


def test_api_key_is_required(server):
    status, _ = _post(f"{server}/chat/completions", json.dumps(QUESTION).encode())
    assert status == 401


def _terminal_chat(source, *flags) -> subprocess.CompletedProcess:
    """``localrl chat SOURCE`` asked one question on stdin."""
    return subprocess.run([sys.executable, "-m", "localrl.cli", "chat", str(source), "--max-tokens", "60", *flags],
                          input="What is 12 + 34?\n", capture_output=True, text=True, timeout=120)


def test_terminal_chat_streams_a_reply(tiny_gguf):
    proc = _terminal_chat(tiny_gguf, "--n-ctx", "256")
    assert proc.returncode == 0, proc.stderr
    assert "<think>" in proc.stdout and "</answer>" in proc.stdout


def test_serve_rejects_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("not a model")
    proc = subprocess.run([sys.executable, "-m", "localrl.cli", "serve", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2 and "not a GGUF file" in proc.stderr


def test_terminal_chat_with_a_torch_model(builtin_model):
    proc = _terminal_chat(builtin_model, "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert "<answer>" in proc.stdout and "</answer>" in proc.stdout


def test_torch_chat_streams_the_greedy_reply_piece_by_piece(builtin_model):
    from localrl.chat import open_chat_model

    model = open_chat_model(str(builtin_model))
    messages = [{"role": "user", "content": "What is 12 + 34?"}]
    pieces = list(model.stream(messages, max_tokens=40))
    ids = model.tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.model.generate(**ids, max_new_tokens=40, do_sample=False, eos_token_id=sorted(model.stops))
    whole = model.tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(pieces) > 5 and "".join(pieces) == whole
