"""Verifiable reward functions."""

import json

import pytest

from localrl.data.rewards import (combine, exact_match, extract_answer, format_reward, numeric_match, regex_match,
                                  resolve_reward, score)
from localrl.errors import UserError


def test_extract_answer_takes_the_last_tag():
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("no tag 42") is None


def test_numeric_match():
    completions = ["<think>x</think><answer>1,025</answer>", "<answer>12.0</answer>", "<answer>13</answer>",
                   "<answer>the sum</answer> 12"]
    assert numeric_match(completions, answer=[1025, "12", "12", "12"]) == [1.0, 1.0, 0.0, 0.0]


def test_numeric_match_has_no_tolerance_beyond_float_rounding():
    """A near miss is wrong: the tolerance is float rounding (1e-9), not a percentage that would
    let 5802 answer 4578 + 1234 = 5812 (0.17% off)."""
    near_misses = {5812: "5802", 1001: "1000", 0.1: "0.10001", 123456789: "123456790", 0: "0.000001",
                   -7: "-7.00001", 1_000_000: "1,000,001"}
    assert numeric_match([f"<answer>{got}</answer>" for got in near_misses.values()],
                         answer=list(near_misses)) == [0.0] * len(near_misses)
    assert numeric_match([f"4578 + 1234 = {got}" for got in near_misses.values()],  # untagged: the last number
                         answer=list(near_misses)) == [0.0] * len(near_misses)
    # what float rounding alone changes still counts: 0.1 + 0.2 printed by Python, and 1e-10 off zero
    assert numeric_match(["<answer>0.30000000000000004</answer>", "<answer>0.0000000001</answer>",
                          "<answer>5812.0</answer>"], answer=[0.3, 0, "5,812"]) == [1.0, 1.0, 1.0]


def test_an_untagged_answer_is_read_as_a_real_model_writes_it():
    # prose: the last number outside any thinking; a tag, when present, is what counts
    assert numeric_match(["457 + 68 = 525", "<think>7+8=15</think>So it is 525.", "<think>525</think>no idea",
                          "It is 143."], answer=[525, 525, 525, 525]) == [1.0, 1.0, 0.0, 0.0]
    assert exact_match(["Let me see.\nAnswer: Paris.", "Paris", "The capital of France is Paris."],
                       answer=["paris"] * 3) == [1.0, 1.0, 0.0]
    assert regex_match(["Working...\nx=3", "x=3\nbut then x=33"], answer=[r"x=\d", r"x=\d"]) == [1.0, 0.0]


def test_exact_and_regex_match():
    assert exact_match(["<answer> Paris </answer>", "<answer>paris.</answer>", "<answer>Pariss</answer>"],
                       answer=["Paris"] * 3) == [1.0, 1.0, 0.0]
    assert regex_match(["<answer>x=3</answer>", "<answer>x=33</answer>"], answer=[r"x=\d", r"x=\d"]) == [1.0, 0.0]


def test_format_reward_needs_think_then_answer():
    assert format_reward(["<think>a</think><answer>b</answer>", "<answer>b</answer>",
                          "<think>a</think><answer>b</answer> trailing"]) == [1.0, 0.0, 0.0]


def test_user_reward_by_import_path_and_errors():
    fn = resolve_reward("tests.test_rewards:length_reward")
    assert score([fn, format_reward], ["ab", "<think></think><answer></answer>"], {"answer": ["", ""]}) == [
        [2.0, 32.0], [0.0, 1.0]]
    assert combine([[1.0, 0.0], [1.0, 1.0]], [1.0, 0.1]) == [1.1, 0.1]
    with pytest.raises(UserError, match="unknown"):
        resolve_reward("nope")
    with pytest.raises(UserError, match="cannot import"):
        resolve_reward("tests.test_rewards:missing")


def test_score_rejects_wrong_length():
    with pytest.raises(UserError, match="returned 1 scores for 2"):
        score([lambda completions, **_: [1.0]], ["a", "b"], {})


def length_reward(completions, **columns):
    return [float(len(c)) for c in completions]


def test_overlong_punishment_equals_trls():
    from trl.rewards import get_soft_overlong_punishment

    from localrl.data.rewards import overlong_punishment

    ids = [[1] * n for n in range(0, 60)]
    ours = overlong_punishment(48, 16)([""] * len(ids), completion_ids=ids)
    assert ours == pytest.approx(get_soft_overlong_punishment(48, 16)(ids))
    assert ours[32] == 0.0 and ours[40] == -0.5 and ours[48] == -1.0 and ours[59] == -1.0


def test_rewards_receive_completion_ids_in_training(builtin_model, tmp_path):
    """The trainer passes each completion's token ids, as TRL does: a reward that reads them sees the
    same lengths the metrics report."""
    from localrl.config import TrainConfig
    from localrl.training.loop import train

    seen = []

    def length_reward(completions, completion_ids, **_):
        seen.append([len(ids) for ids in completion_ids])
        return [float(len(ids) % 2) for ids in completion_ids]

    cfg = TrainConfig(model=str(builtin_model), steps=1, prompts_per_step=2, group_size=2, max_new_tokens=8,
                      eval_size=0, run_dir=str(tmp_path / "run"), quantize="none").validate()
    train(cfg, rewards=([length_reward], [1.0]), log=lambda *a: None)
    assert len(seen) == 1 and len(seen[0]) == 4 and all(1 <= n <= 8 for n in seen[0])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if r["kind"] == "train")  # each reward's mean is logged apart
    assert step["rewards"] == {"length_reward": pytest.approx(sum(n % 2 for n in seen[0]) / 4)}
    assert step["completion_len"] == pytest.approx(sum(seen[0]) / 4)


def test_several_rewards_with_weights_are_each_logged(tmp_path):
    """`--reward a,b --reward-weights x,y`: each reward's mean is logged apart, the reward is their weighted sum."""
    from localrl.data.rewards import resolve_rewards
    from localrl.training.loop import train
    from localrl.training.settings import build_config
    from tests.helpers import QUIET, train_records

    cfg = build_config(None, {"reward": "numeric, tests.test_rewards:length_reward, numeric",
                              "reward_weights": "1, 0.01, 0.5", "steps": 1, "prompts_per_step": 2, "group_size": 2,
                              "max_new_tokens": 16, "eval_size": 0, "run_dir": str(tmp_path / "run")})
    train(cfg, **QUIET)
    [record] = train_records(tmp_path / "run")
    r = record["rewards"]
    # and the built-in task's independent verifier, logged at weight 0 (check_reward = auto)
    assert set(r) == {"numeric_match", "length_reward", "numeric_match_2", "format_reward", "addition_check"}
    assert record["reward_mean"] == pytest.approx(1.5 * r["numeric_match"] + 0.01 * r["length_reward"]
                                                  + 0.1 * r["format_reward"])
    assert r["length_reward"] > 0
    for weights, message in (("1,2", "2 weights for 3 rewards"), ("1,x,2", "not a comma-separated list")):
        with pytest.raises(UserError, match=message):
            resolve_rewards(cfg.reward, weights)
