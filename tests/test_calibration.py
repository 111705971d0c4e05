"""The calibration recipe (RLCR) against hand-computed values: reading a stated confidence, the Brier-score
reward, ECE over 10 bins and its reliability bins; the format and check rewards accept a trailing
confidence; a real model is asked for one; ``localrl eval`` reports ECE and draws the diagram."""

from __future__ import annotations

import json

import pytest

from localrl.data import FORMAT_PROMPT, system_prompt
from localrl.data.arithmetic import addition_check
from localrl.data.calibration import (CONFIDENCE_PROMPT, brier_penalty, brier_score, calibration_summary,
                                       expected_calibration_error, reliability, stated_confidence)
from localrl.data.rewards import combine, default_rewards, format_reward, numeric_match, score
from tests.helpers import localrl, one_line


def test_a_stated_confidence_is_the_last_tag_holding_a_number_in_0_1():
    assert stated_confidence("<answer>5</answer><confidence>0.7</confidence>") == 0.7
    assert stated_confidence("<confidence>0.2</confidence> no, <confidence> 1 </confidence>") == 1.0
    assert stated_confidence("<confidence>85%</confidence>") == pytest.approx(0.85)
    assert stated_confidence("<confidence>.5</confidence>") == 0.5
    for text in ("<answer>5</answer>", "<confidence>1.2</confidence>", "<confidence>high</confidence>",
                 "<confidence>0.7", "<confidence>-0.1</confidence>", "<confidence>120%</confidence>"):
        assert stated_confidence(text) is None, text


def test_the_rlcr_reward_is_correctness_minus_the_brier_score():
    completions = ["<answer>12</answer><confidence>0.8</confidence>",   # right, q 0.8: 1 - 0.04
                   "<answer>13</answer><confidence>0.8</confidence>",   # wrong, q 0.8: 0 - 0.64
                   "<answer>13</answer><confidence>0.1</confidence>",   # wrong, q 0.1: 0 - 0.01
                   "<answer>12</answer><confidence>1.0</confidence>",   # right and sure: 1
                   "<answer>12</answer>"]                               # no confidence: worst Brier, 1 - 1
    columns = {"answer": ["12"] * 5, "completion_ids": [[0]] * 5}
    assert brier_penalty(numeric_match)(completions, **columns) == pytest.approx([-0.04, -0.64, -0.01, 0.0, -1.0])
    fns, weights = default_rewards("numeric", 0.0, calibration_weight=1.0)
    assert [getattr(f, "__name__", "") for f in fns] == ["numeric_match", "format_reward", "calibration"]
    assert combine(score(fns, completions, columns), weights) == pytest.approx([0.96, -0.64, -0.01, 1.0, 0.0])
    assert len(default_rewards("numeric", 0.1)[0]) == 2  # off by default


def test_brier_and_ece_by_hand():
    qs = [0.95, 0.95, 0.15, 0.15, 0.55]
    ys = [1.0, 0.0, 0.0, 0.0, 1.0]
    # Brier: (0.05^2 + 0.95^2 + 0.15^2 + 0.15^2 + 0.45^2) / 5
    assert brier_score(qs, ys) == pytest.approx((0.0025 + 0.9025 + 0.0225 + 0.0225 + 0.2025) / 5)
    # bins 9: 2 answers, conf 0.95, acc 0.5 -> 0.45; bin 1: 2, 0.15, 0 -> 0.15; bin 5: 1, 0.55, 1 -> 0.45
    assert expected_calibration_error(qs, ys) == pytest.approx(2 / 5 * 0.45 + 2 / 5 * 0.15 + 1 / 5 * 0.45)
    bins = reliability(qs, ys)
    assert len(bins) == 10 and [b["n"] for b in bins] == [0, 2, 0, 0, 0, 1, 0, 0, 0, 2]
    assert bins[9]["confidence"] == pytest.approx(0.95) and bins[9]["accuracy"] == 0.5
    assert bins[0]["confidence"] is None and bins[3]["lo"] == pytest.approx(0.3)
    # edges: a tenth lands in its own bin (0.3 in bin 3, not 2), 1.0 in the last, 0.0 in the first
    assert [b["n"] for b in reliability([0.3, 1.0, 0.0, 0.7], [1, 1, 1, 1])] == [1, 0, 0, 1, 0, 0, 0, 1, 0, 1]
    assert expected_calibration_error([1.0, 0.0], [1.0, 0.0]) == 0.0  # perfectly calibrated
    assert expected_calibration_error([0.5] * 4, [1, 0, 1, 0]) == 0.0  # right half the time at 0.5
    assert expected_calibration_error([0.9] * 4, [1, 0, 0, 0]) == pytest.approx(0.65)  # overconfident


def test_the_summary_leaves_out_answers_without_a_confidence():
    texts = ["<answer>1</answer><confidence>0.9</confidence>", "<answer>1</answer>",
             "<answer>2</answer><confidence>0.2</confidence>", "<answer>1</answer><confidence>x</confidence>"]
    summary = calibration_summary(texts, [1.0, 1.0, 0.0, 1.0])
    assert summary["stated"] == 0.5 and summary["confidence_mean"] == pytest.approx(0.55)
    assert summary["ece"] == pytest.approx((0.1 + 0.2) / 2) and summary["brier"] == pytest.approx((0.01 + 0.04) / 2)
    assert calibration_summary(["<answer>1</answer>"], [1.0]) is None


def test_format_and_the_addition_check_accept_a_trailing_confidence():
    text = "<think>2+2=4\n</think><answer>4</answer><confidence>0.9</confidence>"
    assert format_reward([text, text + " more", "<answer>4</answer><confidence>0.9</confidence>"]) == [1.0, 0.0, 0.0]
    assert addition_check([text, text + "<answer>5</answer>"], ["What is 2 + 2?"] * 2) == [1.0, 0.0]


def test_a_real_model_is_asked_for_a_confidence_only_in_a_calibration_run():
    assert system_prompt("auto", "/models/SmolLM2", confidence=True) == FORMAT_PROMPT + " " + CONFIDENCE_PROMPT
    assert system_prompt("auto", "/models/SmolLM2") == FORMAT_PROMPT
    assert system_prompt("auto", "tiny-arith-conf", confidence=True) is None  # learned the tag in pretraining
    assert "<confidence>" in CONFIDENCE_PROMPT


@pytest.mark.slow
def test_eval_reports_calibration_and_draws_the_reliability_diagram(tmp_path):
    """tiny-arith-conf states a confidence after every answer (drawn at random in pretraining); the ECE
    reported is the one its reliability bins give."""
    png = tmp_path / "reliability.png"
    out = localrl("eval", "--model", "tiny-arith-conf", "--eval-size", "40", "--reliability", png, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["confidence_stated"] > 0.9, result
    assert sum(b["n"] for b in result["reliability"]) == round(result["confidence_stated"] * 40)
    bins, n = [b for b in result["reliability"] if b["n"]], sum(b["n"] for b in result["reliability"])
    assert result["ece"] == pytest.approx(sum(b["n"] / n * abs(b["accuracy"] - b["confidence"]) for b in bins))
    assert result["ece"] > 0 and 0.2 < result["confidence_mean"] < 0.8, result
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = localrl("eval", "--model", "tiny-arith-conf", "--eval-size", "8").stdout
    assert "calibration: ECE" in text and "stated one" in text


def test_bad_reliability_paths_fail_in_one_line_before_loading(tmp_path, capsys):
    for path, why in ((tmp_path / "x.txt", "must be a .png file"), (tmp_path / "no" / "x.png", f"no such directory {tmp_path / 'no'}")):
        assert one_line(capsys, "eval", "--reliability", path) == f"localrl: error: eval --reliability {path}: {why}"


@pytest.mark.slow
def test_rlcr_lowers_ece_against_a_plain_run(tmp_path):
    """12 steps each from tiny-arith-conf (its stated confidence random at first): the plain run's accuracy
    rises while its confidence lags (ECE 0.190 here; 0.185 after 20 steps), RLCR's confidence follows (0.077;
    0.070 after 20), at no more than 5 points lower accuracy (97% against 99%)."""
    from localrl.config import TrainConfig
    from localrl.training.loop import train

    after = {}
    for weight in (0.0, 1.0):
        cfg = TrainConfig(model="tiny-arith-conf", steps=12, eval_size=100, calibration_weight=weight,
                          run_dir=str(tmp_path / f"w{weight}"))
        after[weight] = train(cfg, log=lambda *_: None).eval_after
    plain, rlcr = after[0.0], after[1.0]
    assert plain["confidence_stated"] > 0.95 and rlcr["confidence_stated"] > 0.95
    assert rlcr["ece"] < plain["ece"] - 0.05, (plain, rlcr)
    assert rlcr["accuracy"] >= plain["accuracy"] - 0.05
