"""Tree-OPO's prefix trees (``--sampler prefix_tree``): the staged advantages by hand, the built-in teacher's
prefixes, a run from the built-in solver's and from a JSONL of traces, its exact resume, bad settings. (The tree
forward's gradients against the concatenated forward: tests/test_prompt_cache.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from localrl.errors import UserError
from localrl.models import builtin_path
from localrl.modeling import load_tokenizer
from localrl.policy.credit import tree_advantages
from localrl.samplers.prefix_tree import builtin_trace, cut_depths, make_tree
from localrl.training.loop import train
from localrl.training.settings import build_config
from tests.helpers import QUIET, small, train_records

# one tree: three prefixes (steps 0, 1, 2 of the trace), two completions each
REWARDS = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
DEPTHS = torch.tensor([[0, 1, 2]])


@pytest.mark.parametrize("baseline, expected", [
    # values: the subtree's mean (3/6, 3/4, 2/2): r - V = [-.5, -.5, .25, -.75, 0, 0], then less their mean -.25
    ("expectation", [-0.25, -0.25, 0.5, -0.5, 0.25, 0.25]),
    # values: the subtree's best (1, 1, 1): r - V = [-1, -1, 0, -1, 0, 0], mean -.5
    ("optimistic", [-0.5, -0.5, 0.5, -0.5, 0.5, 0.5]),
    # values: the subtree's worst (0, 0, 1): r - V = [0, 0, 1, 0, 0, 0], mean 1/6
    ("pessimistic", [-1 / 6, -1 / 6, 5 / 6, -1 / 6, -1 / 6, -1 / 6]),
])
def test_staged_advantages_by_hand(baseline, expected):
    assert tree_advantages(REWARDS, DEPTHS, 2, baseline, "none").tolist() == pytest.approx(expected)


def test_staged_advantages_are_normalised_over_each_tree_and_zero_where_nothing_differs():
    rewards = torch.cat([REWARDS, torch.ones(6, dtype=torch.float64)])  # a second tree, every completion right
    adv = tree_advantages(rewards, torch.tensor([[0, 1, 2], [0, 0, 1]]), 2)
    staged = torch.tensor([-0.25, -0.25, 0.5, -0.5, 0.25, 0.25], dtype=torch.float64)
    assert adv[:6].tolist() == pytest.approx((staged / (staged.std() + 1e-4)).tolist())
    assert adv[6:].tolist() == [0.0] * 6
    # prefixes cut at the same step are one subtree: each sees the other's completions
    same = tree_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), torch.tensor([[1, 1]]), 2,
                           scale="none")
    assert same.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_the_built_in_teachers_prefixes_end_after_whole_steps():
    tok = load_tokenizer(builtin_path("tiny-arith"))
    trace = builtin_trace({"prompt": "What is 457 + 68?"})
    assert trace == "<think>7+8=15\n5+6+1=12\n4+0+1=5\n</think><answer>525</answer>"
    assert cut_depths(3, 3) == [0, 1, 2] and cut_depths(1, 3) == [0, 0, 0] and cut_depths(4, 2) == [0, 2]
    prompt = tok("What is 457 + 68?")["input_ids"]
    tree = make_tree(tok, prompt, trace, 3)
    assert tree.depths == [0, 1, 2] and tree.texts == ["", "<think>7+8=15\n", "<think>7+8=15\n5+6+1=12\n"]
    assert tree.ends[0] == len(prompt) and tree.ends[-1] == len(tree.trunk)
    for end, text in zip(tree.ends, tree.texts):  # each prefix's tokens are its text's
        assert tok.decode(tree.trunk[len(prompt):end]) == text


def _config(run_dir, **kw):
    return small(run_dir, **{"sampler": "prefix_tree", "prompts_per_step": 2, "group_size": 4, "steps": 2, **kw})


def test_a_prefix_tree_run_trains_from_every_depth(tmp_path):
    """Each step samples from the bare prompt and from each prefix depth. (Its resume: tests/test_resume_contract.py.)"""
    full = train(_config(tmp_path / "full"), **QUIET)
    records = train_records(full.run_dir)
    assert [r["step"] for r in records] == [1, 2] and all(r["completions"] == 2 * 3 * 4 for r in records)


def test_the_prefix_tree_learns_from_a_jsonl_of_traces(tmp_path):
    """A file of prompts and a file of their traces: a step's completions are scored as whole solutions (prefix and
    completion), so from the deepest prefix of a right trace the built-in model is right more often."""
    rows, traces = tmp_path / "sums.jsonl", tmp_path / "traces.jsonl"
    pairs = [(a, b) for a in range(123, 9000, 371) for b in (58, 967, 4499)][:40]
    rows.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                            for a, b in pairs))
    traces.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "trace": builtin_trace(
        {"prompt": f"What is {a} + {b}?"})}) + "\n" for a, b in pairs))
    result = train(_config(tmp_path / "run", data=str(rows), teacher_traces=str(traces), steps=3, prompts_per_step=4,
                           tree_prefixes=2), **QUIET)
    records = train_records(result.run_dir)
    by_prefix = [sum(r["prefix_accuracy"][k] for r in records) / len(records) for k in ("0", "1")]
    assert by_prefix[1] > by_prefix[0], by_prefix


@pytest.mark.parametrize("flags, message", [
    ({"sampler": "nope"}, "config field sampler: must be empty or one of"),
    ({"sampler": "prefix_tree", "tree_prefixes": 0}, "config field tree_prefixes: must be from 1 to 16"),
    ({"sampler": "prefix_tree", "tree_baseline": "mean"}, "config field tree_baseline: must be one of expectation"),
    ({"tree_prefixes": 4}, "config field tree_prefixes: needs sampler prefix_tree"),
    ({"sampler": "prefix_tree", "data": "words"}, "config field teacher_traces: the built-in solver's traces"),
    ({"sampler": "prefix_tree", "objective": "ppo"},
     "config field objective: ppo cannot train with sampler prefix_tree \\(its advantages are GRPO's"),
    ({"sampler": "prefix_tree", "env": "shell"}, "config field sampler: prefix_tree samples prompt completions"),
])
def test_bad_prefix_tree_settings_are_one_line(flags, message):
    with pytest.raises(UserError, match=message):
        build_config(None, flags)


def test_bad_trace_files_stop_before_anything_is_written(tmp_path):
    rows = tmp_path / "sums.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {a} + 7?", "answer": str(a + 7)}) + "\n"
                            for a in range(10, 40)))
    bad = tmp_path / "traces.jsonl"
    bad.write_text(json.dumps({"prompt": "What is 10 + 7?", "trace": 17}) + "\n")
    for traces, message in [(tmp_path / "none.jsonl", "teacher_traces: .*none.jsonl: no such file"),
                            (bad, "traces.jsonl:1: 'trace' must be a string of steps")]:
        with pytest.raises(UserError, match=message):
            train(_config(tmp_path / "run", data=str(rows), teacher_traces=str(traces)), **QUIET)
        assert not (tmp_path / "run").exists()
    bad.write_text(json.dumps({"prompt": "What is 10 + 7?", "trace": "<think>0+7=7\n1+0=1\n</think>"}) + "\n")
    with pytest.raises(UserError, match="no trace of the prompt 'What is 1[1-9] \\+ 7\\?'"):
        train(_config(tmp_path / "run", data=str(rows), teacher_traces=str(bad)), **QUIET)
    with pytest.raises(UserError, match="a file of traces needs data to be a file"):
        train(_config(tmp_path / "run", teacher_traces=str(bad)), **QUIET)
    assert not (tmp_path / "run").exists()
