"""Datasets: the built-in tasks' splits, system prompts and strict JSONL reading."""

import json
import random
import re

import pytest

from localrl.data import load_task
from localrl.data.arithmetic import Problem, held_out_problems, is_held_out, sample_problems, worked_answer
from localrl.data.sources import read_rows
from localrl.errors import UserError


def test_worked_answer_is_right_without_slips_and_consistently_wrong_with_them():
    assert worked_answer(Problem(457, 68)) == "<think>7+8=15\n5+6+1=12\n4+0+1=5\n</think><answer>525</answer>"
    slipped = worked_answer(Problem(457, 68), random.Random(0), drop_carry=1.0)
    assert slipped == "<think>7+8=15\n5+6=11\n4+0=4\n</think><answer>415</answer>"
    for p in sample_problems(random.Random(1), 300):
        assert worked_answer(p).endswith(f"<answer>{p.a + p.b}</answer>")


def test_held_out_problems_never_reach_training():
    held = held_out_problems(200)
    assert held == held_out_problems(200) and len(set(held)) == 200
    assert all(is_held_out(p) for p in held)
    task = load_task("arith")
    train = [r for step in range(20) for r in task.sample(step, 16, seed=3)]
    held_q = {p.question for p in held}
    assert not held_q & {r["prompt"] for r in train}
    assert task.sample(5, 16, seed=3) == task.sample(5, 16, seed=3) != task.sample(6, 16, seed=3)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_rows_and_extra_columns(tmp_path):
    f = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": f"q{i}", "answer": i, "level": i % 3}) for i in range(50)])
    task = load_task(str(f), eval_size=10)
    assert len(task.held_out) == 5 and len(task.rows) == 45
    assert not {r["prompt"] for r in task.held_out} & {r["prompt"] for r in task.rows}
    # every row is seen once per epoch, in a seeded order
    epoch = task.sample(0, 45, seed=1)
    assert sorted(r["prompt"] for r in epoch) == sorted(r["prompt"] for r in task.rows)
    assert task.sample(2, 9, seed=1) == task.sample(2, 9, seed=1)


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "q", "answer": 1', "d.jsonl:2: invalid JSON"),
    ('["prompt", "answer"]', "d.jsonl:2: expected a JSON object"),
    ('{"prompt": "q"}', "d.jsonl:2: missing 'answer'"),
    ('{"prompt": "", "answer": 1}', "d.jsonl:2: 'prompt' is empty"),
    ('{"prompt": [{"role": "user"}], "answer": 1}', "d.jsonl:2: 'prompt' must be a string or a list"),
    ('{"prompt": "q", "answer": null}', "d.jsonl:2: 'answer' must be a string or a number"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad, message):
    f = _write(tmp_path / "d.jsonl", ['{"prompt": "ok", "answer": 1}', bad])
    with pytest.raises(UserError, match=message):
        read_rows(str(f))


def test_empty_and_missing_datasets(tmp_path):
    f = _write(tmp_path / "e.jsonl", ["", "  "])
    with pytest.raises(UserError, match="no rows"):
        load_task(str(f))
    with pytest.raises(UserError, match="no such file, and not a built-in task"):
        load_task(str(tmp_path / "nope.jsonl"))


def test_word_problems_are_right_seeded_and_split():
    from localrl.data import word_problems as wp

    held = wp.held_out_problems(300)
    assert held == wp.held_out_problems(300) and len(set(held)) == 300 and all(wp.is_held_out(p) for p in held)
    train = wp.sample_problems(random.Random(5), 2000)
    assert not set(held) & set(train) and {p.template for p in train} == set(range(wp.TEMPLATES))
    for p in held + train:  # the question's numbers give the answer, every template
        numbers = [int(x) for x in re.findall(r"\d+", p.question)]
        a, b, *rest = numbers
        want = {0: a + b, 1: a - b, 2: a * b, 3: a // b, 4: a * b - (rest[0] if rest else 0),
                5: a + b - (rest[0] if rest else 0)}[p.template]
        assert int(p.answer) == want and want >= 0, p.question
        if p.template == 3:
            assert a % b == 0  # shares come out even
    task = load_task("words", eval_size=20)
    assert len(task.held_out) == 20 and task.sample(3, 8, seed=1) == task.sample(3, 8, seed=1)


def test_real_models_get_the_answer_format_as_a_system_message(builtin_model):
    from localrl.data import FORMAT_PROMPT, system_prompt
    from localrl.generation.rollout import encode_prompts
    from localrl.modeling import load_tokenizer

    assert system_prompt("auto", "tiny-arith") is None  # the built-in model learned the format, no system turn
    assert system_prompt("auto", "/models/SmolLM2") == FORMAT_PROMPT
    assert system_prompt("none", "/models/SmolLM2") is None and system_prompt("Be brief.", "x") == "Be brief."
    tok = load_tokenizer(str(builtin_model))
    rows = [{"prompt": "What is 1 + 2?"}, {"prompt": [{"role": "system", "content": "own"},
                                                      {"role": "user", "content": "Hi"}]}]
    with_system, without = encode_prompts(tok, rows, "Use tags."), encode_prompts(tok, rows)
    assert tok.decode(with_system[0]).startswith("<|im_start|>system\nUse tags.<|im_end|>")
    assert with_system[1] == without[1]  # a row's own system message is kept, not doubled


def test_a_users_answer_pattern_has_a_time_limit_and_an_unmatched_group_is_no_answer():
    import time

    from localrl.data.sources import USER_REGEX_SECONDS, extract_answer

    assert extract_answer("xbar", "regex:(foo)?bar") is None  # the probe's AttributeError
    assert extract_answer("foobar", "regex:(foo)?bar") == "foo"
    assert extract_answer("a" * 34 + "!", "regex:^(a+)+$") is None  # the probe's: past 90 s under Python's re
    started = time.monotonic()
    with pytest.raises(UserError, match=r"^answer format regex:\^\(a\|a\)\*\$: took over 1 s on one answer"):
        extract_answer("a" * 40 + "!", "regex:^(a|a)*$")  # backtracks in any engine: stopped at the limit
    # (without the limit it backtracks for hours; a loaded 2-core machine stretches the limit's check to seconds)
    assert time.monotonic() - started < USER_REGEX_SECONDS + 10
