"""A real llama-cpp-python server on a loopback port, serving a GGUF exported from the built-in model."""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from localrl.quant.export import export

pytestmark = pytest.mark.slow  # a live server, and chat subprocesses

@pytest.fixture(scope="module")
def tiny_gguf(builtin_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    export(builtin_model, out, "f16", check=False, log=lambda *_: None)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: bytes | None = None, key: str | None = None, scheme: str = "Bearer",
             content_type: str = "application/json") -> tuple[int, str]:
    headers = {"Content-Type": content_type} | ({"Authorization": f"{scheme} {key}"} if key else {})
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _post(url: str, body: bytes, key: str | None = None):
    return _request(url, body, key)


def _no_traceback(text: str) -> None:
    """What a client must never see: a Python traceback or a source path."""
    assert "Traceback" not in text and 'File "' not in text, text
    assert ".py" not in text and "site-packages" not in text and "/work/" not in text, text


def _serve(gguf, tmp_path_factory, *flags):
    """A live ``localrl serve`` of ``gguf``; yields its base URL, stops it afterwards."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    log = log_path.open("w")  # a file, not a pipe: a full pipe would stall a server that logs errors
    proc = subprocess.Popen([sys.executable, "-m", "localrl.cli", "serve", str(gguf), "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 60
    while True:
        try:
            request = urllib.request.Request(f"{base}/models", headers={"Authorization": "Bearer sekrit"})
            urllib.request.urlopen(request, timeout=2).read()
            break
        except OSError:
            assert proc.poll() is None, log_path.read_text()
            assert time.time() < deadline, "the server did not answer within 60 s:\n" + log_path.read_text()
            time.sleep(0.3)
    yield base
    proc.terminate()
    proc.wait(timeout=20)
    log.close()


@pytest.fixture(scope="module")
def server(tiny_gguf, tmp_path_factory):
    """The server with an API key and no --n-ctx: its context is the model's training context."""
    yield from _serve(tiny_gguf, tmp_path_factory, "--api-key", "sekrit")


def test_an_agents_tool_calls_come_back_in_openais_tool_calls_field(tmp_path_factory):
    from localrl.models import builtin_path

    gguf = tmp_path_factory.mktemp("agent") / "tiny-shell.gguf"
    export(builtin_path("tiny-shell"), gguf, "f16", check=False, log=lambda *_: None)
    tools = [{"type": "function", "function": {"name": "shell", "description": "run a shell command",
                                               "parameters": {"type": "object", "properties": {
                                                   "command": {"type": "string"}}}}}]
    request = {"messages": [{"role": "user", "content": "How many lines are in maple.txt?"}], "max_tokens": 48,
               "temperature": 0}
    for base in _serve(gguf, tmp_path_factory):
        status, text = _post(f"{base}/chat/completions", json.dumps(request | {"tools": tools}).encode())
        assert status == 200, text
        choice = json.loads(text)["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "shell"
        assert "maple" in json.loads(call["function"]["arguments"])["command"]
        # streamed, through OpenAI's own client: the same call, as one tool_calls delta
        import openai

        client = openai.OpenAI(base_url=base, api_key="none")
        stream = client.chat.completions.create(model="x", tools=tools, stream=True, **request)
        chunks = [c.choices[0] for c in stream]
        deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
        assert [d.function.name for d in deltas] == ["shell"] and deltas[0].id == "call_0"
        assert json.loads(deltas[0].function.arguments) == json.loads(call["function"]["arguments"])
        assert chunks[-1].finish_reason == "tool_calls"
        assert "".join(c.delta.content or "" for c in chunks) == (choice["message"]["content"] or "")
        # without tools the same reply stays text, as the model wrote it
        status, text = _post(f"{base}/chat/completions", json.dumps(request).encode())
        message = json.loads(text)["choices"][0]["message"]
        assert "tool_calls" not in message or not message["tool_calls"]
        assert message["content"].startswith("<tool_call>")


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


def test_malformed_request_gets_a_json_400_whatever_the_bearer_scheme_case(server):
    # HTTPBearer takes the scheme in any case; before the middleware did too, these reached llama-cpp-python
    # and came back as 500s naming its app.py
    for scheme in ("bearer", "BEARER", "Bearer"):
        for path, body in (("chat/completions", b'{"messages": 5}'), ("chat/completions", b"[]"),
                           ("completions", b'{"prompt": 5}'), ("completions", b'{"prompt": "x", "max_tokens": -1')):
            status, text = _request(f"{server}/{path}", body, "sekrit", scheme)
            assert status == 400, (scheme, path, body, text)
            assert json.loads(text)["error"]["type"] == "invalid_request_error"
            _no_traceback(text)
    status, text = _request(f"{server}/chat/completions", json.dumps(QUESTION).encode(), "sekrit", "bearer")
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"], text  # the key was accepted


def test_a_wrong_key_gets_401_whatever_the_scheme_case(server):
    for scheme in ("bearer", "Bearer"):
        for body in (b'{"messages": 5}', json.dumps(QUESTION).encode()):
            status, text = _request(f"{server}/chat/completions", body, "wrong", scheme)
            assert status == 401, text
    status, text = _request(f"{server}/chat/completions", json.dumps(QUESTION).encode(), "sekrit", "Basic")
    assert status == 401, text


LONG_PROMPT = "1+1=" * 100  # 400 tokens (the tokenizer is byte-level), beyond the model's 256


def test_the_context_defaults_to_the_models_training_context(server, tiny_gguf):
    from localrl.quant.gguf_info import read_gguf_info

    assert read_gguf_info(tiny_gguf).context_length == 256  # the fixture passes no --n-ctx
    fits = {"prompt": "1+1=" * 60, "max_tokens": 4, "temperature": 0}  # 240 tokens
    status, text = _post(f"{server}/completions", json.dumps(fits).encode(), "sekrit")
    assert status == 200 and json.loads(text)["usage"]["prompt_tokens"] == 240, text
    status, text = _post(f"{server}/completions", json.dumps(fits | {"prompt": LONG_PROMPT}).encode(), "sekrit")
    assert status == 400 and "maximum context length is 256 tokens" in json.loads(text)["error"]["message"], text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", [
    ("completions", {"prompt": LONG_PROMPT, "max_tokens": 5}),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 5}),
])
def test_a_prompt_longer_than_the_context_gets_a_400(server, path, body, stream):
    # streamed, llama-cpp-python used to answer 200 and then nothing
    status, text = _post(f"{server}/{path}", json.dumps(body | {"stream": stream}).encode(), "sekrit")
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
    assert "256" in error["message"], error


def test_embeddings_are_refused_with_a_json_404(server):
    status, text = _post(f"{server}/embeddings", json.dumps({"input": "hi"}).encode(), "sekrit")
    assert status == 404, text
    error = json.loads(text)["error"]
    assert "embeddings are not served" in error["message"] and error["type"] == "invalid_request_error"
    status, _ = _post(f"{server}/embeddings", json.dumps({"input": "hi"}).encode())
    assert status == 401  # the key is still checked first


def test_the_other_routes_answer(server):
    root = server.removesuffix("/v1")
    status, text = _request(f"{server}/models", None, "sekrit")
    assert status == 200 and [m["id"] for m in json.loads(text)["data"]] == ["tiny"], text
    status, text = _post(f"{root}/extras/tokenize", json.dumps({"input": "1+1=2"}).encode(), "sekrit")
    tokens = json.loads(text)["tokens"]
    assert status == 200 and len(tokens) == 5, text
    status, text = _post(f"{root}/extras/tokenize/count", json.dumps({"input": "1+1=2"}).encode(), "sekrit")
    assert status == 200 and json.loads(text) == {"count": 5}, text
    status, text = _post(f"{root}/extras/detokenize", json.dumps({"tokens": tokens}).encode(), "sekrit")
    assert status == 200 and json.loads(text) == {"text": "1+1=2"}, text
    body = {"prompt": "1+1=", "max_tokens": 4, "temperature": 0}
    status, text = _post(f"{server}/engines/copilot-codex/completions", json.dumps(body).encode(), "sekrit")
    assert status == 200 and json.loads(text)["choices"][0]["text"], text
    for path, request in (("completions", body), ("chat/completions", QUESTION)):  # never the file's path
        status, text = _post(f"{server}/{path}", json.dumps(request).encode(), "sekrit")
        assert status == 200 and json.loads(text)["model"] == "tiny", text
        _no_traceback(text)
    status, text = _request(f"{root}/nowhere", None, "sekrit")
    assert status == 404, text


@pytest.mark.parametrize("path, body, param", [
    ("/extras/detokenize", {"tokens": [99999999]}, "tokens"),  # llama.cpp aborts the process on these
    ("/extras/detokenize", {"tokens": [-5]}, "tokens"),
    ("/v1/completions", {"prompt": "1+1=", "max_tokens": 4, "grammar": "root ::= ((("}, "grammar"),  # a crash
    ("/v1/completions", {"prompt": "1+1=", "max_tokens": 4, "stream": True, "grammar": "x ::= \"1\""}, "grammar"),
    ("/v1/chat/completions", QUESTION | {"grammar": "((("}, "grammar"),
    ("/v1/completions", {"prompt": "1+1=", "max_tokens": 4, "logit_bias": {"99999": 5}}, "logit_bias"),  # ignored
    ("/v1/completions", {"prompt": ["1+1=", "2+2="], "max_tokens": 4}, "prompt"),  # an assertion: a 500
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, "prompt"),  # an assertion: a 500
])
def test_requests_llama_cpp_would_fail_on_get_a_400_and_the_server_lives(server, path, body, param):
    root = server.removesuffix("/v1")
    status, text = _post(f"{root}{path}", json.dumps(body).encode(), "sekrit")
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    status, _ = _request(f"{server}/models", None, "sekrit")
    assert status == 200
    ok = {"prompt": "1+1=", "max_tokens": 4, "grammar": 'root ::= "2"'}  # a grammar that parses is used
    status, text = _post(f"{server}/completions", json.dumps(ok).encode(), "sekrit")
    assert status == 200 and json.loads(text)["choices"][0]["text"] == "2", text


def test_a_body_sent_as_another_content_type_gets_a_400(server):
    # FastAPI reads it as bytes, and llama-cpp-python answered with a 500 naming its app.py
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        status, text = _request(f"{server}/completions", b'{"prompt": "1+1="}', "sekrit", content_type=content_type)
        assert status == 400 and "Content-Type: application/json" in json.loads(text)["error"]["message"], text
        _no_traceback(text)


def test_failures_are_json_500s_without_a_traceback(server):
    root = server.removesuffix("/v1")
    status, text = _post(f"{root}/extras/tokenize", json.dumps({"input": "é"}).encode(), "sekrit")
    tokens = json.loads(text)["tokens"]
    assert status == 200 and len(tokens) == 2, text  # bytes: the first alone is half a UTF-8 character
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 4}
    tools = QUESTION | {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                        "tool_choice": {"type": "function", "function": {"name": "g"}}}
    for path, body in (("/extras/detokenize", {"tokens": tokens[:1]}),  # llama-cpp-python's decode fails
                       ("/v1/chat/completions", parts),  # the chat template takes text content only
                       ("/v1/chat/completions", tools), ("/v1/chat/completions", tools | {"stream": True})):
        status, text = _post(f"{root}{path}", json.dumps(body).encode(), "sekrit")
        assert status == 500, (path, text)
        error = json.loads(text)["error"]  # llama-cpp-python's own type was "internal_server_error"
        assert error["type"] == "server_error" and error["message"].startswith("internal error: "), error
        assert len(error["message"].splitlines()) == 1 and len(error["message"]) > len("internal error: ")
        _no_traceback(text)
    status, text = _post(f"{root}/extras/detokenize", json.dumps({"tokens": tokens}).encode(), "sekrit")
    assert status == 200 and json.loads(text) == {"text": "é"}, text  # the whole character decodes


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "serve: --port must be 1-65535 (got 70000)"),
    (["--port", "0"], "serve: --port must be 1-65535 (got 0)"),
    (["--n-ctx", "-5"], "serve: --n-ctx must be 0 (the model's training context) or more (got -5)"),
])
def test_serve_checks_its_flags_in_one_line(tiny_gguf, flags, message):
    proc = subprocess.run([sys.executable, "-m", "localrl.cli", "serve", str(tiny_gguf), *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"localrl: error: {message}"], proc.stderr


def test_serve_reports_a_port_in_use_in_one_line(tiny_gguf):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "localrl.cli", "serve", str(tiny_gguf), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"localrl: error: serve: port {port} on 127.0.0.1 is in use ("), line


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
