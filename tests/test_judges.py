"""Judges behind OpenAI-compatible endpoints: ``--reward judge:URL|MODEL`` and ``experience_judge = http://...``,
asked over real HTTP: a scripted judge on a loopback port (known replies, failures on demand, a required key) and
``localrl serve`` of a built-in GGUF. Retries, failures, unparsable replies and cached replies are counted, never
scored 0; an unreachable judge is one line before anything is written."""

from __future__ import annotations

import pytest

from localrl.data.judge import judge_reward, parse_score
from localrl.errors import UserError
from localrl.generation.endpoint import Endpoint, EndpointSettings
from localrl.policy.experience import load_library
from localrl.training.loop import train
from tests.helpers import (HAND_LESSONS, QUIET, ScriptedJudge, free_port, grade_by_reference, small, train_records,
                           write_lessons)

FAST = EndpointSettings(concurrency=3, timeout=10.0, retries=2)


def test_an_endpoint_is_a_url_and_perhaps_a_model():
    assert repr(Endpoint("http://127.0.0.1:8080", "reward")) == "http://127.0.0.1:8080/v1"
    assert repr(Endpoint(" http://h:11434/v1/ | qwen2.5:7b ", "reward")) == "http://h:11434/v1|qwen2.5:7b"
    with pytest.raises(UserError, match=r"^config field experience_judge: 'http://' is not an http\(s\)://HOST"):
        Endpoint("http://", "experience_judge")


def test_scores_are_read_from_the_judges_words():
    assert [parse_score(r) for r in ("Score: 7", "**Score:** 10", "score=3/10", "I'd say Score 0.", "Score: 11",
                                     "seven out of ten")] == [0.7, 1.0, 0.3, 0.0, None, None]


def test_the_judge_reward_retries_caches_counts_and_never_scores_a_failure_0(monkeypatch):
    monkeypatch.setenv("LOCALRL_JUDGE_API_KEY", "sekrit")
    completions = ["<answer>5</answer>", "<answer>6</answer>", "<answer>5</answer>", "<answer>2</answer>"]
    columns = {"prompt": ["2+3", "2+3", "2+3", "1+1"], "answer": ["5", "5", "5", "2"]}
    with ScriptedJudge(grade_by_reference, fail=[503, 500], key="sekrit") as judge:
        reward = judge_reward(f"judge:{judge.url}|{ScriptedJudge.MODEL}", FAST)
        assert reward(completions, **columns) == [1.0, 0.0, 1.0, 1.0]
        # two failures retried; the third completion is the first's request again: asked once
        assert reward.take_stats() == {"judge_requests": 3, "judge_failed": 0, "judge_retries": 2, "judge_cached": 1,
                                       "judge_unparsed": 0}
        assert len(judge.requests) == 5 and set(judge.authorizations) == {"Bearer sekrit"}
        assert reward(completions[:1], prompt=columns["prompt"][:1], answer=["5"]) == [1.0]  # from the cache
        assert reward.take_stats()["judge_cached"] == 1 and len(judge.requests) == 5

    # a request refused for good (a 400 is not retried) takes its group's mean, and is counted
    with ScriptedJudge(grade_by_reference, fail=[400]) as judge:
        reward = judge_reward(f"judge:{judge.url}", EndpointSettings(concurrency=1, timeout=10.0, retries=2))
        scores = reward(["<answer>5</answer>", "<answer>5</answer> again", "<answer>6</answer>"],
                        prompt=["2+3"] * 3, answer=["5"] * 3)
        assert scores == [0.5, 1.0, 0.0]
        assert reward.take_stats() | {} == {"judge_requests": 3, "judge_failed": 1, "judge_retries": 0,
                                            "judge_cached": 0, "judge_unparsed": 0}

    # a reply without a score is counted apart; a call that judged nothing stops in one line
    with ScriptedJudge(lambda messages: "It looks fine to me.") as judge:
        reward = judge_reward(f"judge:{judge.url}", FAST)
        with pytest.raises(UserError, match=r"^reward judge: http://127\.0\.0\.1:\d+/v1\|scripted-judge judged none "
                                            r"of 2 completions; no reply stated a score \(the first: 'It looks"):
            reward(completions[:2], prompt=columns["prompt"][:2], answer=["5", "5"])
        assert reward.take_stats()["judge_unparsed"] == 2


def test_an_unreachable_judge_is_one_line_before_the_run_starts(builtin_model, tmp_path):
    closed = f"http://127.0.0.1:{free_port()}/v1|m"
    with pytest.raises(UserError, match=r"^config field reward: the judge at http://127\.0\.0\.1:\d+/v1 does not "
                                        r"answer \(.*refused.*\); start the server or fix the URL$"):
        train(small(tmp_path / "a", steps=1, reward=f"numeric,judge:{closed}", judge_retries=0), **QUIET)
    with pytest.raises(UserError, match=r"^config field experience_judge: the judge at .* does not answer"):
        train(small(tmp_path / "b", steps=1, objective="experience", experience_judge=closed, judge_retries=0),
              **QUIET)
    with ScriptedJudge(write_lessons) as judge, pytest.raises(UserError, match=r"does not serve 'gpt-9' \(it lists "
                                                                                r"scripted-judge\)"):
        train(small(tmp_path / "c", steps=1, objective="experience", experience_judge=f"{judge.url}|gpt-9"), **QUIET)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_a_run_with_a_judge_reward_logs_its_scores_and_counts(builtin_model, tmp_path):
    """The scripted judge grades as the verifier does (the answer tag against the reference): each step's judge
    reward equals its numeric reward, and every request is in the step's counts."""
    with ScriptedJudge(grade_by_reference) as judge:
        run = train(small(tmp_path / "run", steps=2, reward=f"numeric,judge:{judge.url}|{ScriptedJudge.MODEL}"),
                    **QUIET)
        probed = 2  # the rewards are tried on two made-up completions before the run starts
        records = train_records(run.run_dir)
        assert all(r["rewards"]["judge"] == pytest.approx(r["rewards"]["numeric_match"]) for r in records)
        assert 0 < records[0]["rewards"]["judge"] < 1
        assert all(r["judge_failed"] == 0 and r["judge_requests"] + r["judge_cached"] == 16 for r in records)
        assert sum(r["judge_requests"] for r in records) + probed == len(judge.requests)


def test_requests_failed_one_after_another_stop_at_the_stated_number():
    """FAILURES_IN_A_ROW failed requests (each after its retries) are one line naming the endpoint and its last
    error; an answered request in between starts the count again."""
    from localrl.generation.endpoint import FAILURES_IN_A_ROW

    ask = [[{"role": "user", "content": f"question {i}"}] for i in range(2 * FAILURES_IN_A_ROW)]
    once = EndpointSettings(concurrency=4, timeout=10.0, retries=0)
    with ScriptedJudge(lambda m: "Score: 5", fail=[500] * (FAILURES_IN_A_ROW - 1) + [200] +
                       [500] * (FAILURES_IN_A_ROW - 1)) as judge:
        endpoint = Endpoint(judge.url, "reward", once)
        for i in range(2 * FAILURES_IN_A_ROW - 1):  # one at a time: the order the server fails them in
            endpoint.chat(ask[i:i + 1], 8)
        assert endpoint.take_stats()["failed"] == 2 * FAILURES_IN_A_ROW - 2
    with ScriptedJudge(lambda m: "Score: 5", fail=[500] * 1000) as judge:
        endpoint = Endpoint(judge.url, "experience_judge", once)
        with pytest.raises(UserError, match=rf"^config field experience_judge: the judge at http://127\.0\.0\.1:\d+/v1"
                                            rf"\|scripted-judge failed {FAILURES_IN_A_ROW} requests in a row, each "
                                            rf"after 0 retries \(the last: .*500.*\); stopping rather than going on "
                                            rf"without it$"):
            endpoint.chat(ask[:FAILURES_IN_A_ROW], 8)


def test_training_free_grpo_stops_in_one_line_when_its_judge_fails_every_request(builtin_model, tmp_path, capsys):
    """Before, the run went on to exit 0, its only trace judge_failed in metrics.jsonl."""
    from tests.helpers import one_line

    with ScriptedJudge(write_lessons, fail=[500] * 10_000) as judge:
        line = one_line(capsys, "train", "--objective", "experience", "--experience-judge",
                        f"{judge.url}|{ScriptedJudge.MODEL}", "--judge-retries", "0", "--steps", "30",
                        "--prompts-per-step", "8", "--eval-size", "0", "--run-dir", tmp_path / "run")
    assert "experience_judge: the judge at" in line and "requests in a row" in line, line
    steps = train_records(tmp_path / "run")
    assert 0 < len(steps) < 30 and all(r["judge_failed"] == r["judge_requests"] for r in steps)


def test_training_free_grpo_stops_in_one_line_when_its_judge_answers_only_in_prose(builtin_model, tmp_path, capsys):
    from localrl.objectives.experience import PROSE_IN_A_ROW
    from tests.helpers import one_line

    with ScriptedJudge(lambda messages: "Both answers look reasonable to me.") as judge:
        line = one_line(capsys, "train", "--objective", "experience", "--experience-judge",
                        f"{judge.url}|{ScriptedJudge.MODEL}", "--steps", "40", "--prompts-per-step", "8",
                        "--group-size", "4", "--max-new-tokens", "48", "--eval-size", "0", "--run-dir", tmp_path / "run")
    assert line == (f"localrl: error: config field experience_judge: the judge's last {PROSE_IN_A_ROW} replies held no "
                    f"edit (a line ADD, MODIFY, DELETE or KEEP), so the library cannot learn; the last: 'Both answers "
                    f"look reasonable to me.' (a judge that follows the format: a larger model, or an endpoint)")
    assert 0 < len(train_records(tmp_path / "run")) < 40


def test_training_free_grpo_with_a_judge_behind_an_endpoint(builtin_model, tmp_path):
    """The scripted judge writes the two hand-written lessons into the library, as far as the room the prompt keeps
    for them allows (the built-in model's tokens are characters: in 160 of them, the first lesson, 169 tokens with
    the header, does not fit; the second, 110, does); no weight changes."""
    import torch
    from safetensors.torch import load_file

    with ScriptedJudge(write_lessons) as judge:
        run = train(small(tmp_path / "run", steps=2, save_every=1, objective="experience", experience_tokens=160,
                          experience_judge=f"{judge.url}|{ScriptedJudge.MODEL}"), **QUIET)
    records = train_records(run.run_dir)
    assert records[0]["judged_groups"] > 0 and records[0]["edits"] == 1 and records[0]["invalid_edits"] >= 1
    assert all(r["judge_requests"] + r["judge_cached"] == r["judged_groups"] and r["judge_failed"] == 0
               for r in records)
    assert list(load_library(run.run_dir).lessons.values()) == [HAND_LESSONS[1]]
    adapters = [load_file(str(run.run_dir / "checkpoints" / f"step-{s:06d}" / "adapter_model.safetensors"))
                for s in (1, 2)]
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])


@pytest.mark.slow
def test_judges_served_by_localrl_serve(builtin_model, tmp_path):
    """``localrl serve`` of the built-in model's GGUF as both judges. With a context that holds the requests, they
    all come back (the built-in model writes no lessons: its replies are invalid edits, counted); with the model's
    own 256 tokens, the server refuses every judge request (400), and the run stops in one line before it starts."""
    from localrl.quant.export import export
    from tests.helpers import serving

    gguf = tmp_path / "tiny.gguf"
    export(builtin_model, gguf, "f16", check=False, log=lambda *_: None)
    (tmp_path / "wide").mkdir()
    for base, _ in serving(gguf, tmp_path / "wide", "--n-ctx", "2048"):
        run = train(small(tmp_path / "run", steps=1, prompts_per_step=8, objective="experience",
                          experience_judge=base, experience_judge_tokens=24), **QUIET)
        record = train_records(run.run_dir)[0]
        assert record["judged_groups"] > 0 and record["judge_requests"] > 0 and record["judge_failed"] == 0
        assert record["judge_reply"] and record["edits"] == 0
    (tmp_path / "narrow").mkdir()
    for base, _ in serving(gguf, tmp_path / "narrow"):
        with pytest.raises(UserError, match=r"^reward judge: http://127\.0\.0\.1:\d+/v1\|\S+ judged none of 2 "
                                            r"completions; its last error: HTTP 400: .*context"):
            train(small(tmp_path / "run2", steps=1, reward=f"numeric,judge:{base}", judge_retries=0), **QUIET)
    assert not (tmp_path / "run2").exists()


def test_localrl_eval_of_the_run_gives_the_judges_lessons_as_the_run_did(builtin_model, tmp_path):
    """`localrl eval RUN` of a training-free GRPO run whose judge answered over HTTP: the lessons it wrote are in
    every prompt (the evaluation holds room for them in the context, as the run did), and the figure is the run's
    own evaluation after training."""
    from localrl.commands.eval import evaluate_policy
    from localrl.training.loop import resume_config

    with ScriptedJudge(write_lessons) as judge:
        run = train(small(tmp_path / "run", steps=1, eval_size=16, objective="experience", experience_tokens=160,
                          experience_judge=f"{judge.url}|{ScriptedJudge.MODEL}"), **QUIET)
    assert list(load_library(run.run_dir).lessons.values()) == [HAND_LESSONS[1]]
    result = evaluate_policy(resume_config(run.run_dir, {}), run.run_dir, samples=0)
    assert result["accuracy"] == run.eval_after["accuracy"] and "with the 1 lessons" in result["model"]


class _RawServer:
    """A loopback server that answers every connection with ``reply(sock)`` (a thread each): for what no honest
    server sends."""

    def __init__(self, reply):
        import socket
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        self.reply = reply
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import threading

        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        try:
            conn.recv(65536)
            self.reply(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.listener.close()


def _json_reply(payload: bytes):
    def reply(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(payload), payload))
    return reply


def _a_byte_a_second(conn):
    import time

    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    for _ in range(60):
        conn.sendall(b" ")
        time.sleep(1)


@pytest.mark.parametrize("listing", [b'{"data": null}', b'{"data": 5}', b'[1, 2]', b'{"data": [5, "x"]}'])
def test_a_server_that_lists_its_models_oddly_is_one_line(listing):
    server = _RawServer(_json_reply(listing))
    try:
        with pytest.raises(UserError, match=r"^config field reward: http://127\.0\.0\.1:\d+/v1 lists no model"):
            Endpoint(server.url, "reward", FAST).check()
    finally:
        server.close()


def test_a_judge_that_answers_a_byte_a_second_is_given_up_on_within_its_timeout():
    import time

    server = _RawServer(_a_byte_a_second)
    try:
        started = time.monotonic()
        with pytest.raises(UserError, match=r"does not answer \(no whole reply within 2 s\)"):
            Endpoint(server.url + "|m", "reward", EndpointSettings(timeout=2.0, retries=0)).check()
        assert time.monotonic() - started < 4  # (the acceptance: its one line within 10 s)
        endpoint = Endpoint(server.url + "|m", "reward", EndpointSettings(timeout=2.0, retries=0))
        endpoint._checked = True
        started = time.monotonic()
        assert endpoint.chat([[{"role": "user", "content": "hi"}]], 8) == [None]
        assert time.monotonic() - started < 4 and "no whole reply within 2 s" in endpoint.last_error
    finally:
        server.close()
