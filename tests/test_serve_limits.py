"""What one request may make the server parse, checked in-process in milliseconds (the live attacks are in
test_serve.py): the grammar, stop and logit-bias bounds, and the Gate's order (headers, then the key, then the
body, read only up to its limit)."""

import asyncio
import time

import pytest

from localrl.serving.limits import RequestLimits, grammar_shape
from localrl.serving.gate import Gate


@pytest.mark.parametrize("grammar, shape", [
    ('root ::= "a"', (1, 0)), ('root ::= ("a" | "b")*', (1, 1)), ('root ::= (("a"))\nx ::= "b"', (2, 2)),
    ('root ::= "(((" [(] "::=" # (((( ::=\nx ::= ("\\"(")', (2, 1)), ("root ::= " + "(" * 20000 + '"a"' + ")" * 20000,
                                                                  (1, 20000)),
])
def test_a_grammars_rules_and_depth_are_read_as_llama_cpp_reads_them(grammar, shape):
    assert grammar_shape(grammar) == shape


@pytest.mark.parametrize("request_, param, named", [
    ({"grammar": "root ::= " + "(" * 65 + '"a"' + ")" * 65}, "grammar", "max_grammar_depth"),
    ({"grammar": "".join(f"r{i} ::= r{i + 1}\n" for i in range(1025))}, "grammar", "max_grammar_rules"),
    ({"grammar": 'root ::= "' + "a" * 70000 + '"'}, "grammar", "max_grammar_bytes"),
    ({"response_format": {"type": "json_object", "schema": {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"}
                                                                      for i in range(1100)}}}},
     "response_format", "max_grammar_rules"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "max_stops"), ({"stop": "x" * 1025}, "stop", "max_stop_chars"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "max_logit_bias"),
])
def test_each_bound_is_named_with_its_flag(request_, param, named):
    where, message = RequestLimits().problem(request_)
    assert where == param and named in message and f"--{named.replace('_', '-')}" in message


def test_requests_at_the_bounds_pass():
    limits = RequestLimits()
    assert limits.problem({"grammar": "root ::= " + "(" * 64 + '"a"' + ")" * 64, "stop": ["x" * 1024] * 16,
                           "logit_bias": {str(i): 1 for i in range(1024)}}) is None
    with pytest.raises(ValueError, match="--max-stops"):
        RequestLimits(max_stops=0).check()


def _call(gate: Gate, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, bytes | None, list]:
    """(status, the body the app was handed or None, what the client's receive() was asked) for one request."""
    asked, seen, sent = [], {}, []

    async def receive():
        asked.append(len(asked))
        chunk = chunks[len(asked) - 1]
        return {"type": "http.request", "body": chunk, "more_body": len(asked) < len(chunks)}

    async def send(message):
        sent.append(message)

    async def app(scope, receive_, send_):
        message = await receive_()
        seen["body"] = message["body"]
        await send_({"type": "http.response.start", "status": 200, "headers": []})
        await send_({"type": "http.response.body", "body": b"{}"})

    gate.app = app
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    asyncio.run(gate(scope, receive, send))
    return sent[0]["status"], seen.get("body"), asked


def test_the_key_is_checked_before_any_of_the_body_is_read():
    gate = Gate(None, frozenset({"localhost"}), False, "sekrit", max_body=64)
    status, body, asked = _call(gate, [(b"host", b"localhost"), (b"authorization", b"Bearer wrong")], [b"{}"] * 3)
    assert status == 401 and body is None and asked == []
    status, body, asked = _call(gate, [(b"host", b"localhost"), (b"authorization", b"Bearer sekrit")], [b"{}"])
    assert status == 200 and body == b"{}" and asked == [0]


def test_a_chunked_body_one_byte_over_the_limit_is_refused_and_one_at_it_served():
    gate = Gate(None, frozenset({"localhost"}), False, None, max_body=100)
    host = [(b"host", b"localhost")]
    status, body, _ = _call(gate, host, [b" " * 40, b" " * 40, b" " * 18 + b"{}"])
    assert status == 200 and len(body) == 100
    status, body, asked = _call(gate, host, [b" " * 40, b" " * 40, b" " * 19 + b"{}", b"never read"])
    assert status == 413 and body is None and len(asked) == 3


def test_more_headers_than_the_bound_get_a_431_before_the_key():
    gate = Gate(None, frozenset({"localhost"}), False, "sekrit", max_headers=10)
    status, body, asked = _call(gate, [(b"host", b"localhost")] + [(b"x-%d" % i, b"v") for i in range(10)], [b"{}"])
    assert status == 431 and asked == []


def test_a_key_file_must_be_a_small_regular_file_and_a_readable_one_is_warned_about(tmp_path):
    import os

    from localrl.errors import UserError
    from localrl.serving.gate import api_key_from

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, why in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"), (tmp_path, "not a regular"),
                      (tmp_path / "missing", "cannot read it")):
        with pytest.raises(UserError, match=f"^serve --api-key-file {path}: {why}"):
            api_key_from(key_file=path)
    big = tmp_path / "big"
    big.write_bytes(b"k" * 5000)
    with pytest.raises(UserError, match="5000 bytes; a key file holds one key"):
        api_key_from(key_file=big)
    key, warned = tmp_path / "key", []
    key.write_text("sekrit\n")
    key.chmod(0o600)
    assert api_key_from(key_file=key, warn=warned.append) == "sekrit" and warned == []
    key.chmod(0o644)
    assert api_key_from(key_file=key, warn=warned.append) == "sekrit" and "chmod 600" in warned[0]


@pytest.fixture(scope="module")
def bounded_server():
    """uvicorn with the bounded protocol (head 0.5 s, idle 1.5 s) in front of an app that answers 200, on a free
    port of this process."""
    import socket
    import threading

    import uvicorn

    from localrl.serving.bounded_http import bounded_protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.create_server(("127.0.0.1", 0))
    limits = RequestLimits(header_timeout=0.5, idle_timeout=1.5)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=bounded_protocol(limits), lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(5)
    sock.close()


def _answer(port: int, wait: float, pieces: list[bytes], pause: float) -> tuple[float, bytes]:
    """(seconds from the first piece until the server answered or closed, what it answered) for a connection that
    waits ``wait`` seconds, then sends ``pieces`` ``pause`` seconds apart."""
    import socket

    with socket.create_connection(("127.0.0.1", port)) as sock:
        time.sleep(wait)
        start = time.monotonic()
        for piece in pieces:
            try:
                sock.sendall(piece)
            except OSError:
                break
            time.sleep(pause)
        sock.settimeout(5)
        answer = sock.recv(400)
        return time.monotonic() - start, answer


HEAD = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"


def test_a_slow_head_is_timed_from_its_first_byte_and_an_idle_connection_closed_without_a_word(bounded_server):
    # a head a byte every 0.2 s, begun after a wait longer than the head's own time: a 408 at 0.5 s from its start
    elapsed, answer = _answer(bounded_server, 0.8, [HEAD[:20], *[bytes([b]) for b in HEAD[20:]]], 0.2)
    assert answer.startswith(b"HTTP/1.1 408") and b"header_timeout" in answer and 0.4 < elapsed < 1.0, (elapsed,
                                                                                                          answer)
    # the same wait, then a whole head: served
    elapsed, answer = _answer(bounded_server, 0.8, [HEAD], 0)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    # nothing sent: closed at the idle time, with nothing answered
    elapsed, answer = _answer(bounded_server, 0, [], 0)
    assert answer == b"" and 1.3 < elapsed < 2.5, (elapsed, answer)


def test_a_head_under_the_bound_is_served_however_it_arrives(bounded_server):
    """h11's own bound on an unfinished head (16 KiB) is not the server's: a 40 KiB head sent in two pieces (the
    first unfinished and over 16 KiB) is served, and one over ``max_header_bytes`` is a 431 naming it either way."""
    head = b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (40 << 10) + b"\r\n\r\n"
    for pieces in ([head], [head[:20 << 10], head[20 << 10:]]):
        _, answer = _answer(bounded_server, 0, pieces, 0.1)
        assert answer.startswith(b"HTTP/1.1 200"), answer
    big = b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (70 << 10)
    for pieces in ([big], [big[:20 << 10], big[20 << 10:]]):
        _, answer = _answer(bounded_server, 0, pieces, 0.1)
        assert answer.startswith(b"HTTP/1.1 431") and b"max_header_bytes" in answer, answer
