"""A real llama-cpp-python server on a loopback port, serving a GGUF exported from the built-in model."""

import http.client
import itertools
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from localrl.quant.export import export
from tests.helpers import free_port as _free_port
from tests.helpers import server_environment as _environment
from tests.helpers import serving

pytestmark = pytest.mark.slow  # a live server, and chat subprocesses

@pytest.fixture(scope="module")
def tiny_gguf(builtin_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    export(builtin_model, out, "f16", check=False, log=lambda *_: None)
    return out


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


PIDS: dict[str, int] = {}  # a live server's base URL: its process id


def _serve(gguf, tmp_path_factory, *flags, env: dict | None = None):
    """A live ``localrl serve`` of ``gguf``; yields its base URL, stops it afterwards."""
    for base, proc in serving(gguf, tmp_path_factory.mktemp("serve"), *flags, env=env):
        PIDS[base] = proc.pid
        yield base


@pytest.fixture(scope="module")
def server(tiny_gguf, tmp_path_factory):
    """The server with an API key (from a file) and no --n-ctx: its context is the model's training context."""
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text("sekrit\n")
    yield from _serve(tiny_gguf, tmp_path_factory, "--api-key-file", str(key_file))


@pytest.fixture(scope="module")
def open_server(tiny_gguf, tmp_path_factory):
    """The server without a key (the default), web pages from one origin let in, one more Host name served, a body
    of 6 MiB allowed; the head's time at its default (1 s)."""
    yield from _serve(tiny_gguf, tmp_path_factory, "--cors-origin", "http://localhost:3000",
                      "--allowed-host", "models.example", "--max-body-bytes", str(6 << 20))


SHELL_TOOLS = [{"type": "function", "function": {"name": "shell", "description": "run a shell command",
                                                "parameters": {"type": "object", "properties": {
                                                    "command": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    """The built-in agent (tiny-shell) exported and served without a key."""
    from localrl.models import builtin_path

    gguf = tmp_path_factory.mktemp("agent-gguf") / "tiny-shell.gguf"
    export(builtin_path("tiny-shell"), gguf, "f16", check=False, log=lambda *_: None)
    yield from _serve(gguf, tmp_path_factory)


def _sent_back(message, call, shape: str) -> list:
    """Turn 1's assistant message and the tool's result, as a client of the given kind sends them back."""
    result = {"role": "tool", "tool_call_id": call.id, "content": "7\n[exit code 0]"}
    function = {"name": call.function.name, "arguments": call.function.arguments}
    assistant = {
        "as-returned": message,  # the client's own object
        "model_dump": message.model_dump(),  # every field: refusal, annotations, audio, function_call as null
        "exclude_none": message.model_dump(exclude_none=True),  # content left out
        "exclude_unset": message.model_dump(exclude_unset=True),
        "content-empty": {**message.model_dump(exclude_none=True), "content": ""},
        # by hand, content as a list of parts, the tool's name on its result
        "parts": {"role": "assistant", "content": [], "tool_calls": [{"id": call.id, "type": "function",
                                                                       "function": function}]},
        "legacy-function": {"role": "assistant", "content": None, "function_call": function},
    }[shape]
    if shape == "model_dump":
        assert {"refusal", "annotations", "audio", "function_call"} <= {k for k, v in assistant.items() if v is None}
    if shape == "exclude_none":
        assert "content" not in assistant
    if shape == "parts":
        result = {**result, "name": call.function.name, "content": [{"type": "text", "text": result["content"]}]}
    if shape == "legacy-function":
        result = {"role": "function", "name": call.function.name, "content": result["content"]}
    return [assistant, result]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("shape", ["as-returned", "model_dump", "exclude_none", "exclude_unset", "content-empty",
                                   "parts", "legacy-function"])
def test_the_official_openai_client_completes_a_two_turn_tool_loop(agent_server, shape, stream):
    """Turn 1 asks for a command; the client sends the assistant message back in one of the shapes OpenAI's API
    takes, with a ``tool`` message holding the command's output; turn 2 answers."""
    from openai import OpenAI

    client = OpenAI(base_url=agent_server, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "How many lines are in maple.txt?"}]
    first = client.chat.completions.create(model="tiny-shell", messages=messages, tools=SHELL_TOOLS, max_tokens=48,
                                           temperature=0)
    message = first.choices[0].message
    [call] = message.tool_calls
    assert message.content in (None, "") and "maple.txt" in call.function.arguments
    messages += _sent_back(message, call, shape)
    second = client.chat.completions.create(model="tiny-shell", messages=messages, tools=SHELL_TOOLS, max_tokens=48,
                                            temperature=0, stream=stream)
    if stream:
        chunks = list(second)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    else:
        text, finish = second.choices[0].message.content, second.choices[0].finish_reason
    assert finish == "stop" and "<answer>7</answer>" in text, (finish, text, call.function.arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_langchains_openai_chat_model_completes_a_two_turn_tool_loop(agent_server, stream):
    """Another widely used client, which builds the messages it sends back from its own message types."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=agent_server, api_key="unused", model="tiny-shell", temperature=0, max_tokens=48,
                      max_retries=0, streaming=stream).bind_tools(SHELL_TOOLS)
    messages = [HumanMessage("How many lines are in maple.txt?")]
    first = chat.invoke(messages)
    [call] = first.tool_calls
    assert call["name"] == "shell" and "maple.txt" in call["args"]["command"], first
    messages += [first, ToolMessage("7\n[exit code 0]", tool_call_id=call["id"])]
    second = chat.invoke(messages)
    assert not second.tool_calls and "<answer>7</answer>" in second.content, second


ASKED = {"role": "user", "content": "How many lines are in maple.txt?"}
CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]}


@pytest.mark.parametrize("messages, param", [
    ([ASKED, {"role": "wizard", "content": "hi"}], "messages[1].role"),
    ([{"content": "hi"}], "messages[0].role"),
    ([ASKED, {**CALLED, "tool_calls": [{"id": "call_0", "type": "function", "function": {"arguments": "{}"}}]}],
     "messages[1].tool_calls[0].function.name"),
    ([ASKED, {**CALLED, "tool_calls": [{"id": "call_0", "function": {"name": "shell", "arguments": {}}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([ASKED, {**CALLED, "refusal": 5}], "messages[1].refusal"),
    ([ASKED, {**CALLED, "audio": {"id": "audio_1"}}], "messages[1].audio"),
    ([ASKED, CALLED, {"role": "tool", "content": "7"}], "messages[2].tool_call_id"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 7}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": 7}], "messages[0].content"),
    ([{"role": "system"}], "messages[0].content"),
    ([ASKED, "hello"], "messages[1]"),
])
def test_a_message_the_api_would_refuse_gets_a_400_naming_its_index_and_field(server, messages, param):
    status, text = _post(f"{server}/chat/completions", json.dumps({"messages": messages, "max_tokens": 4}).encode(),
                         "sekrit")
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    assert "ChatCompletionRequest" not in error["message"]


def test_developer_messages_and_text_parts_are_what_a_system_message_and_plain_text_are(server):
    """OpenAI's newer system role and content as a list of text parts: the same reply as the plain shapes."""
    plain = {"messages": [{"role": "system", "content": "Answer briefly."}, QUESTION["messages"][0]],
             "max_tokens": 24, "temperature": 0}
    shaped = {**plain, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}], "name": None},
        {"role": "user", "content": [{"type": "text", "text": QUESTION["messages"][0]["content"]}]}]}
    replies = []
    for request in (plain, shaped):
        status, text = _post(f"{server}/chat/completions", json.dumps(request).encode(), "sekrit")
        assert status == 200, text
        replies.append(json.loads(text)["choices"][0]["message"]["content"])
    assert replies[0] == replies[1] and replies[0]


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
    tools = QUESTION | {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                        "tool_choice": {"type": "function", "function": {"name": "g"}}}
    for path, body in (("/extras/detokenize", {"tokens": tokens[:1]}),  # llama-cpp-python's decode fails
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


def test_a_context_beyond_the_memory_is_one_line_before_llama_cpp_loads(tiny_gguf):
    """(llama.cpp tried for seconds, then failed with its own line.)"""
    proc = _serve_command(tiny_gguf, "--n-ctx", "100000000", env={**_environment(), "LOCALRL_FREE_MEMORY": "8GB"})
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert re.fullmatch(r"localrl: error: serve: --n-ctx 100000000 needs about [\d.]+ GiB \(the weights and a "
                        r"100000000-token key/value cache of [\d.]+ GiB\), more than the 8\.0 GiB of memory available; "
                        r"give a smaller --n-ctx \(the model was trained on 256 tokens\)", proc.stderr.strip()), proc.stderr


def test_a_host_that_is_no_address_is_one_line_without_the_insecure_warning_first(tiny_gguf):
    proc = _serve_command(tiny_gguf, "--host", "not a host", "--insecure")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("localrl: error: serve: cannot listen on not a host port 8000 (")


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
    from localrl.serving.chat import open_chat_model

    model = open_chat_model(str(builtin_model))
    messages = [{"role": "user", "content": "What is 12 + 34?"}]
    pieces = list(model.stream(messages, max_tokens=40))
    ids = model.tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.model.generate(**ids, max_new_tokens=40, do_sample=False, eos_token_id=sorted(model.stops))
    whole = model.tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(pieces) > 5 and "".join(pieces) == whole


# What a security probe of the server found, each attack asserted to fail.

def _http(base: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers with lower-case names, text) of one request to ``base``'s server, on 127.0.0.1 always."""
    port = int(base.split(":")[2].split("/")[0])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body, headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode()
    finally:
        connection.close()


def _vm(pid: int, field: str) -> int:
    """A VmRSS/VmHWM line of /proc/PID/status, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _exchange(base: str, head: bytes, pieces=(), pause: float = 0.0, whole: bool = False) -> tuple[float, bytes]:
    """(seconds until the server answered or closed, its first bytes; with ``whole``, all it sends within 2 s more)
    for ``head`` sent at once, then each of ``pieces`` sent by a thread (``pause`` seconds apart) for as long as the
    server takes them, while this one waits for the answer."""
    port = int(base.split(":")[2].split("/")[0])
    sock = socket.create_connection(("127.0.0.1", port))
    start = time.time()
    sock.sendall(head)

    def pump():
        try:
            for piece in pieces:
                sock.sendall(piece)
                time.sleep(pause)
        except OSError:  # the server closed the connection: it is not reading the rest
            pass

    sender = threading.Thread(target=pump, daemon=True)
    sender.start()
    sock.settimeout(40)
    try:
        answer = sock.recv(400)
    except OSError as e:
        answer = repr(e).encode()
    elapsed = time.time() - start
    sock.settimeout(2)
    try:
        while whole and (more := sock.recv(4000)) and len(answer) < 8000:  # the rest, for its message
            answer += more
    except OSError:
        pass
    sock.close()
    sender.join(30)
    return elapsed, answer


def _send_huge_body(base: str, headers: str, chunked: bool, size: int = 50 << 20) -> tuple[float, bytes]:
    """``_exchange`` of a POST of ``size`` bytes, with a Content-Length or chunked."""
    port = int(base.split(":")[2].split("/")[0])
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\n{headers}{framing}\r\n\r\n").encode()
    piece = b"[" * (1 << 16)
    frame = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
    return _exchange(base, head, itertools.repeat(frame, size // len(piece)))


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("which, key, status", [("server", None, 401), ("server", "sekrit", 413),
                                                ("open_server", None, 413)])
def test_a_50_mb_body_is_refused_at_once_and_never_read(request, which, key, status, chunked):
    # before, a 50 MB body took 100 s and 1.5 GB, blocking every other request, with a key or without
    base = request.getfixturevalue(which)
    pid = PIDS[base]
    before = _vm(pid, "VmRSS")
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM (the peak) starts again from VmRSS
    except OSError:
        pass
    peaks = []
    done = threading.Event()

    def watch():  # VmRSS sampled as well, should clear_refs be refused
        while not done.is_set():
            peaks.append(_vm(pid, "VmRSS"))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    elapsed, answer = _send_huge_body(base, auth, chunked)
    time.sleep(0.3)  # whatever the server still does with it
    done.set()
    watcher.join()
    growth = max(_vm(pid, "VmHWM"), *peaks) - before
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer
    assert elapsed < 1.0, elapsed
    assert growth < 50 << 20, f"the server grew by {growth >> 20} MB"
    status_after, _ = _request(f"{base}/models", None, "sekrit")
    assert status_after == 200  # and it still answers


@pytest.mark.parametrize("which, limit", [("server", 4 << 20), ("open_server", 6 << 20)])
def test_a_body_within_the_limit_is_served_and_the_limit_can_be_raised(request, which, limit):
    base = request.getfixturevalue(which)
    body = json.dumps({"prompt": "1+1=", "max_tokens": 2, "user": "x" * (limit - 100)}).encode()  # (ignored)
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sekrit"}
    # http.client sends the whole body, then reads the answer, on a connection kept open: uvicorn drops the rest of
    # a refused body and the 413 arrives (urllib asks for the connection to close, and uvicorn closes it unread)
    status, _, text = _http(base, "POST", "/v1/completions", body, headers)
    assert status == 200, text[:300]
    status, _, text = _http(base, "POST", "/v1/completions", body + b" " * 200, headers)
    assert status == 413 and json.loads(text)["error"]["param"] == "body", text
    assert f"limit of {limit} bytes (its --max-body-bytes)" in json.loads(text)["error"]["message"]


DEEP = b"[" * 100_000  # Python's json recursed into it and failed with a RecursionError: a 500
DEEP_IN_A_TOOL = json.dumps(QUESTION | {"tools": [{"type": "function", "function": {
    "name": "f", "parameters": {"type": "object", "x": json.loads("[" * 70 + "]" * 70)}}}]}).encode()


@pytest.mark.parametrize("body", [b'{"messages": 5}', b'{"messages": [{"role":', b"[]", b"", b"\xff\xfe",
                                  DEEP, DEEP_IN_A_TOOL, json.dumps(QUESTION).encode()],
                         ids=["wrong-type", "truncated", "array", "empty", "not-utf8", "deep", "deep-in-a-tool",
                              "good"])
def test_a_request_without_the_key_gets_401_whatever_its_body(server, body):
    for path in ("/v1/chat/completions", "/v1/completions", "/extras/tokenize", "/v1/embeddings"):
        for headers in ({"Content-Type": "application/json"}, {"Content-Type": "text/plain"},
                        {"Content-Type": "application/json", "Authorization": "Bearer wrong"}):
            status, response_headers, text = _http(server, "POST", path, body, headers)
            assert status == 401, (path, headers, text)
            assert json.loads(text)["error"]["code"] == "invalid_api_key", text
            assert response_headers.get("www-authenticate") == "Bearer"
    status, _, text = _http(server, "GET", "/v1/models")
    assert status == 401, text


@pytest.mark.parametrize("which", ["server", "open_server"])
def test_json_nested_too_deep_gets_a_400_before_any_parser_recurses(request, which):
    base = request.getfixturevalue(which)
    for path, body in (("chat/completions", DEEP), ("chat/completions", DEEP_IN_A_TOOL), ("completions", DEEP)):
        status, text = _post(f"{base}/{path}", body, "sekrit")
        assert status == 400, text
        error = json.loads(text)["error"]
        assert error["param"] == "body" and "nested more than 64 levels" in error["message"], error
    # brackets inside strings are text, however many
    root = base.removesuffix("/v1")
    status, text = _post(f"{root}/extras/tokenize/count", json.dumps({"input": "[{" * 100 + '"\\'}).encode(), "sekrit")
    assert status == 200 and json.loads(text) == {"count": 202}, text


def _reference_depth(value) -> int:
    if isinstance(value, (list, dict)):
        return 1 + max(map(_reference_depth, value.values() if isinstance(value, dict) else value), default=0)
    return 0


def test_json_depth_equals_the_parsed_documents_depth():
    from localrl.serving.gate import json_depth

    rng = random.Random(0)
    alphabet = '[]{}"\\ax\n\u00e9'  # strings full of what the scan must see through: brackets, quotes, escapes

    def text():
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))

    def value(depth):
        r = rng.random()
        if depth > 12 or r < 0.3:
            return rng.choice([text(), 1, None, True, 2.5])
        if r < 0.65:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {text(): value(depth + 1) for _ in range(rng.randint(0, 4))}

    for _ in range(2000):
        document = value(0)
        for ascii_only in (True, False):
            body = json.dumps(document, ensure_ascii=ascii_only).encode()
            assert json_depth(body) == _reference_depth(document), body
    assert json_depth(DEEP) == 100_000 and json_depth(b'"' + b"[" * 99 + b'"') == 0
    assert json_depth(b'["\\\\", [["\\"]"]]]') == 3  # an escaped backslash, then an escaped quote


CORS = ("access-control-allow-origin", "access-control-allow-credentials", "access-control-allow-methods",
        "access-control-allow-headers")


def _preflight(base: str, origin: str):
    return _http(base, "OPTIONS", "/v1/chat/completions", None, {
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_no_web_page_may_call_the_server_by_default(server):
    # llama-cpp-python answered every origin's preflight with that origin, credentials allowed
    status, headers, _ = _preflight(server, "http://evil.example")
    assert not [h for h in headers if h.startswith("access-control-")], headers
    status, headers, text = _http(server, "POST", "/v1/chat/completions", json.dumps(QUESTION).encode(),
                                  {"Origin": "http://evil.example", "Content-Type": "application/json",
                                   "Authorization": "Bearer sekrit"})
    assert status == 200 and not [h for h in headers if h.startswith("access-control-")], headers


def test_cors_origin_lets_in_that_origin_only(open_server):
    status, headers, _ = _preflight(open_server, "http://localhost:3000")
    assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000", headers
    assert "access-control-allow-credentials" not in headers
    assert "authorization" in headers["access-control-allow-headers"].lower()
    for origin in ("http://evil.example", "http://localhost:3001", "null"):
        status, headers, _ = _preflight(open_server, origin)
        assert status != 200 and "access-control-allow-origin" not in headers, (origin, headers)
        status, headers, _ = _http(open_server, "GET", "/v1/models", None, {"Origin": origin})
        assert status == 200 and "access-control-allow-origin" not in headers, (origin, headers)
    status, headers, _ = _http(open_server, "GET", "/v1/models", None, {"Origin": "http://localhost:3000"})
    assert headers["access-control-allow-origin"] == "http://localhost:3000", headers


def test_a_request_for_another_host_is_refused(server, open_server):
    # a DNS rebinding sends the attacker's own name: a web page's requests reach the server with it
    port = server.split(":")[2].split("/")[0]
    for host in ("evil.example", f"evil.example:{port}", f"localhost.evil.example:{port}", "models.example"):
        status, _, text = _http(server, "GET", "/v1/models", None, {"Host": host, "Authorization": "Bearer sekrit"})
        assert status == 403 and json.loads(text)["error"]["code"] == "host_not_allowed", (host, text)
        status, _, text = _http(server, "POST", "/v1/chat/completions", DEEP, {"Host": host})  # before anything
        assert status == 403, (host, text)
    for host in (f"localhost:{port}", "LOCALHOST", f"127.0.0.1:{port}", f"[::1]:{port}"):
        status, _, text = _http(server, "GET", "/v1/models", None, {"Host": host, "Authorization": "Bearer sekrit"})
        assert status == 200, (host, text)
    open_port = open_server.split(":")[2].split("/")[0]
    for host, expected in ((f"models.example:{open_port}", 200), ("models.example", 200), ("evil.example", 403)):
        status, _, text = _http(open_server, "GET", "/v1/models", None, {"Host": host})
        assert status == expected, (host, text)


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", QUESTION | {"max_tokens": -5}, "max_tokens"),  # was: no limit at all
    ("chat/completions", QUESTION | {"max_tokens": 0}, "max_tokens"),
    ("chat/completions", QUESTION | {"max_tokens": 1e30}, "max_tokens"),
    ("chat/completions", QUESTION | {"max_tokens": 257}, "max_tokens"),  # the context is 256
    ("completions", {"prompt": "1+1=", "max_tokens": -5}, "max_tokens"),
    ("completions", {"prompt": "1+1=", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "1+1=", "max_tokens": 10 ** 30}, "max_tokens"),
    ("chat/completions", QUESTION | {"n": 5}, "n"),  # was: one choice back, n ignored
    ("chat/completions", QUESTION | {"n": -1}, "n"),
    ("completions", {"prompt": "1+1=", "max_tokens": 4, "n": 2}, "n"),
    ("completions", {"prompt": "1+1=", "max_tokens": 4, "best_of": 3}, "best_of"),
])
def test_max_tokens_and_n_out_of_range_get_a_400_naming_the_field(server, path, body, param):
    status, text = _post(f"{server}/{path}", json.dumps(body).encode(), "sekrit")
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    fits = body | ({"max_tokens": 4, "n": 1, "best_of": 1} if path == "completions" else {"max_tokens": 256, "n": 1})
    status, text = _post(f"{server}/{path}", json.dumps(fits).encode(), "sekrit")
    assert status == 200, text


def test_the_key_comes_from_the_api_key_file(server):
    assert _request(f"{server}/models", None, "sekrit")[0] == 200
    assert _request(f"{server}/models", None, "sekritx")[0] == 401  # the file's line, not a prefix of it
    assert _request(f"{server}/models", None)[0] == 401


def test_the_key_comes_from_the_environment(tiny_gguf, tmp_path_factory):
    for base in _serve(tiny_gguf, tmp_path_factory, env=_environment(LOCALRL_API_KEY="sekrit")):
        assert _request(f"{base}/models", None, "sekrit")[0] == 200
        assert _request(f"{base}/models", None)[0] == 401
        status, text = _post(f"{base}/chat/completions", json.dumps(QUESTION).encode(), "other")
        assert status == 401, text


def _serve_command(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localrl.cli", "serve", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env or _environment())


@pytest.mark.parametrize("host", ["192.0.2.1", "::ffff:192.0.2.1", "models.example"])
def test_a_host_other_than_loopback_without_a_key_is_refused_in_one_line(tiny_gguf, host):
    # refused before anything binds: a bind to these addresses, none of this machine's, would fail otherwise
    proc = _serve_command(tiny_gguf, "--host", host, "--port", _free_port())
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"localrl: error: serve: --host {host} is reachable from other machines: require a key "
        "(--api-key-file PATH or LOCALRL_API_KEY), or serve it to anyone with --insecure"], proc.stderr
    assert proc.stdout == ""


def test_insecure_serves_without_a_key_with_a_warning(tiny_gguf):
    """The warning comes once the address is bound (an address that cannot be is one line, without it)."""
    import selectors

    proc = subprocess.Popen([sys.executable, "-m", "localrl.cli", "serve", str(tiny_gguf), "--host", "0.0.0.0",
                             "--port", str(_free_port()), "--insecure"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=_environment())
    try:
        with selectors.DefaultSelector() as ready:
            ready.register(proc.stdout, selectors.EVENT_READ)
            assert ready.select(timeout=60), "no line in 60 s"
        line = proc.stdout.readline()
        assert line.startswith("warning: serving on 0.0.0.0 with no API key (--insecure)"), line
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_loopback_is_told_apart():
    from localrl.serving.gate import is_loopback, served_hosts

    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LocalHost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "", "192.168.1.5", "::ffff:192.0.2.1", "localhost.evil.example"]))
    assert served_hosts("127.0.0.1") == (frozenset({"localhost", "127.0.0.1", "::1"}), False)
    assert served_hosts("0.0.0.0", ("Models.Example:80",)) == (
        frozenset({"0.0.0.0", "localhost", "127.0.0.1", "::1", "models.example"}), True)
    assert served_hosts("192.168.1.5") == (frozenset({"192.168.1.5"}), False)


def test_api_key_on_the_command_line_warns_that_others_can_read_it(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("not a model")
    proc = _serve_command(bad, "--api-key", "sekrit")
    [warning, error] = proc.stderr.splitlines()
    assert warning.startswith("localrl: warning: --api-key is visible to other users in the process list"), warning
    assert "not a GGUF file" in error


@pytest.mark.parametrize("flags, message", [
    (["--cors-origin", "*"], "serve --cors-origin '*': must be one origin, scheme://host[:port], such as "
                             "http://localhost:3000"),
    (["--cors-origin", "http://x.example/app"], "serve --cors-origin 'http://x.example/app': must be one origin, "
                                                "scheme://host[:port], such as http://localhost:3000"),
    (["--allowed-host", "http://x.example"], "serve --allowed-host 'http://x.example': must be a host name such as "
                                             "myhost.lan (no scheme, path or wildcard: name each host)"),
    (["--allowed-host", "*"], "serve --allowed-host '*': must be a host name such as myhost.lan (no scheme, path or "
                              "wildcard: name each host)"),
    (["--api-key-file", "/dev/zero"], "serve --api-key-file /dev/zero: not a regular file (a FIFO, device or "
                                      "directory cannot hold a key)"),
    (["--header-timeout", "nan"], "serve: --header-timeout must be a positive number (got nan)"),
    (["--max-body-bytes", "0"], "serve: --max-body-bytes must be at least 1 (got 0)"),
    (["--api-key", "a", "--api-key-file", "k"], "serve: give --api-key or --api-key-file, not both"),
    (["--api-key-file", "/nonexistent/key"], "serve --api-key-file /nonexistent/key: cannot read it (No such file "
                                             "or directory)"),
])
def test_serve_checks_its_security_flags_in_one_line(tiny_gguf, flags, message):
    proc = _serve_command(tiny_gguf, *flags)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"localrl: error: {message}"], proc.stderr


def test_an_empty_key_is_refused(tiny_gguf, tmp_path):
    empty = tmp_path / "key"
    empty.write_text("\n")
    for flags in (["--api-key-file", empty], ["--api-key", " "]):
        proc = _serve_command(tiny_gguf, *flags)
        assert proc.returncode == 2 and "the key must be one word of printable ASCII" in proc.stderr, proc.stderr


def test_a_long_terminal_chat_drops_its_oldest_turns_and_says_so_once(builtin_model, monkeypatch):
    """With the built-in model (a context of 256 tokens) the third message used to end the program."""
    import io

    from localrl.serving import chat

    replies, opened = [], chat.open_chat_model

    def counted(source, n_ctx=0):  # the model, noting how many messages each reply was asked with
        model = opened(source, n_ctx)
        stream = model.stream

        def noted(messages, **kw):
            replies.append(len(messages))
            yield from stream(messages, **kw)
        model.stream = noted
        return model

    monkeypatch.setattr(chat, "open_chat_model", counted)
    questions = [f"What is {10 + i} + {20 + i}? Please answer carefully." for i in range(8)]
    out, err = io.StringIO(), io.StringIO()
    chat.terminal_chat(builtin_model, max_tokens=60, temperature=0.0, stdin=io.StringIO("\n".join(questions) + "\n"),
                       stdout=out, stderr=err)
    assert replies[:2] == [1, 3] and len(replies) > len(questions)  # some attempts did not fit, and were retried
    assert max(replies) < 2 * len(questions) - 1  # the later ones without the oldest turns
    assert err.getvalue().splitlines()[0].startswith("chatting with tiny-arith (temperature 0, up to 60 tokens")
    assert err.getvalue().count("its oldest turns are dropped") == 1, err.getvalue()


# What the second probe found: one request that killed or stalled the server. Each is answered 4xx in a second, while
# an ordinary request is answered as usual.

def _completion(grammar: str | None = None, **fields) -> bytes:
    return json.dumps({"prompt": "2+2=", "max_tokens": 4, **({"grammar": grammar} if grammar else {}),
                       **fields}).encode()


NESTED = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000  # the probe's: llama.cpp's parser recursed off its stack
CHAINED = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(190000)) + 'r190000 ::= "a"\n'
RULES = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(2000)) + 'r2000 ::= "a"\n'


@pytest.mark.parametrize("attack, status, named", [
    ("nested grammar", 400, "max_grammar_depth"), ("190,000 chained rules", 400, "max_grammar_bytes"),
    ("2,000 rules", 400, "max_grammar_rules"), ("300,000 stop strings", 400, "max_stops"),
    ("a 100 MiB head", 431, "max_header_bytes"), ("1,000 headers", 431, "max_headers"),
    ("a head a byte a second", 408, "header_timeout")])
def test_a_request_built_to_kill_or_stall_the_server_is_refused_and_others_are_served(open_server, attack, status,
                                                                                    named):
    base = open_server
    port = int(base.split(":")[2].split("/")[0])
    post = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"

    def with_body(body: bytes) -> bytes:
        return f"{post}Content-Length: {len(body)}\r\n\r\n".encode() + body

    exchanges = {
        "nested grammar": lambda: _exchange(base, with_body(_completion(NESTED)), whole=True),
        "190,000 chained rules": lambda: _exchange(base, with_body(_completion(CHAINED)), whole=True),
        "2,000 rules": lambda: _exchange(base, with_body(_completion(RULES)), whole=True),
        "300,000 stop strings": lambda: _exchange(base, with_body(_completion(
            stop=[f"s{i}" for i in range(300000)], logit_bias={"0": -100})), whole=True),
        "a 100 MiB head": lambda: _exchange(base, f"{post}X-Big: ".encode(), itertools.repeat(b"a" * (1 << 16), 1600),
                                            whole=True),
        "1,000 headers": lambda: _exchange(base, (post + "".join(f"X-{i}: v\r\n" for i in range(1000))).encode()
                                           + b"Content-Length: 2\r\n\r\n{}", whole=True),
        "a head a byte a second": lambda: _exchange(base, post.encode(), itertools.repeat(b"X", 30), pause=1.0,
                                                    whole=True),
    }
    result = {}
    attacker = threading.Thread(target=lambda: result.update(answer=exchanges[attack]()))
    attacker.start()
    time.sleep(0.2)
    started = time.time()
    ordinary, text = _post(base + "/completions", _completion())  # another client, meanwhile
    ordinary_seconds = time.time() - started
    attacker.join(60)
    elapsed, answer = result["answer"]
    assert answer.startswith(f"HTTP/1.1 {status}".encode()) and named.encode() in answer, answer
    assert elapsed < (1.25 if status == 408 else 1), elapsed  # 408: at --header-timeout's 1 s, from the head's start
    assert ordinary == 200 and ordinary_seconds < 2, (ordinary, ordinary_seconds, text)
