"""TRL's dataset types, told by their columns: preference rows select the preferences sampler for dpo by themselves,
prompt-completion rows are `localrl sft --data`'s demonstrations, and rows an objective cannot use are one line
naming the objective that can."""

from __future__ import annotations

import json

import pytest
import torch

from localrl.config import TrainConfig
from localrl.data.dataset_types import row_type, source_type
from localrl.errors import UserError
from localrl.samplers import samplers
from localrl.training.loop import train
from localrl.training.settings import build_config, check_config
from tests.helpers import QUIET, one_line, record_sessions, write_demonstrations, write_pairs

# TRL's own examples of each type (its dataset-formats page), standard and conversational
USER, ASSISTANT = [{"role": "user", "content": "The sky is"}], [{"role": "assistant", "content": "blue."}]
WRONG = [{"role": "assistant", "content": "green."}]


@pytest.mark.parametrize("row, kind", [
    ({"prompt": "The sky is"}, "prompt_only"),
    ({"prompt": USER}, "prompt_only"),
    ({"prompt": "What is 2 + 2?", "answer": "4", "completion": "4"}, "prompt_only"),  # localrl's answer column
    ({"prompt": "The sky is", "completion": " blue."}, "prompt_completion"),
    ({"prompt": USER, "completion": ASSISTANT}, "prompt_completion"),
    ({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, "preference"),
    ({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "preference"),  # implicit prompt
    ({"prompt": USER, "chosen": ASSISTANT, "rejected": WRONG}, "preference"),
    ({"prompt": "The sky is", "completion": " blue.", "label": True}, "unpaired_preference"),
    ({"prompt": "1+1=", "completions": ["2", "3"], "labels": [True, False]}, "stepwise_supervision"),
    ({"text": "The sky is blue."}, "language_modeling"),
    ({"messages": USER + ASSISTANT}, "language_modeling"),
    ({"question": "The sky is", "solution": "blue"}, None),  # other names: the sampler's --prompt-column says
])
def test_a_rows_type_is_told_by_its_columns_as_trl_tells_it(row, kind):
    assert row_type(row) == kind


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("typed")

    def write(name: str, rows: list[dict]) -> str:
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(root / name)

    return {
        "pairs": write_pairs(root / "pairs.jsonl", 40),  # conversational
        "plain pairs": write("plain.jsonl", [{"prompt": f"What is {i} + 1?", "chosen": f"<answer>{i + 1}</answer>",
                                              "rejected": f"<answer>{i + 2}</answer>"} for i in range(40)]),
        "demos": write_demonstrations(root / "demos.jsonl", 200),
        "chat demos": write_demonstrations(root / "chat-demos.jsonl", 40, conversational=True),
        "unpaired": write("kto.jsonl", [{"prompt": "The sky is", "completion": " blue.", "label": True}]),
        "stepwise": write("prm.jsonl", [{"prompt": "1+1=", "completions": ["2"], "labels": [True]}]),
        "text": write("lm.jsonl", [{"text": "The sky is blue."}]),
        "sessions": str(record_sessions(root, "long-options", n=2)),  # a directory localrl agent --record wrote
    }


@pytest.mark.parametrize("source, objective, sampler", [
    ("pairs", "dpo", "preferences"),
    ("plain pairs", "dpo", "preferences"),
    ("sessions", "dpo", "preferences"),
    ("demos", "sft", "demonstrations"),
    ("chat demos", "sft", "demonstrations"),
])
def test_the_datas_columns_select_the_sampler_that_reads_them(sources, source, objective, sampler):
    assert samplers.selected(build_config(None, {"objective": objective, "data": sources[source]})) == sampler


@pytest.mark.parametrize("source, flags, message", [
    ("pairs", [], r"its rows are preference pairs \({prompt, chosen, rejected}: TRL's DPO data\); objective grpo "
                  r"cannot train on them; objectives that can: dpo \(--objective dpo\)$"),
    ("demos", ["--objective", "dpo"], r"its rows are prompt-completion rows .*; objective dpo cannot train on them; "
                                      r"objectives that can: sft \(--objective sft\)$"),
    ("unpaired", ["--objective", "dpo"], r"unpaired preferences \({prompt, completion, label}: TRL's KTO data\); "
                                         r"objective dpo cannot train on them; no objective here takes them$"),
    ("stepwise", [], r"stepwise supervision .*; no objective here takes them$"),
    ("text", ["--objective", "sft"], r"language-modeling rows .*; objective sft cannot train on them; no objective "
                                     r"here takes them$"),
    ("pairs", ["--objective", "dpo", "--sampler", "completions"],
     r"sampler completions does not read them; sampler preferences does \(--sampler preferences\)$"),
])
def test_rows_an_objective_cannot_use_are_one_line_naming_what_can(sources, capsys, tmp_path, source, flags, message):
    import re

    line = one_line(capsys, "train", "--data", sources[source], *flags, "--run-dir", tmp_path / "run")
    assert line.startswith(f"localrl: error: data {sources[source]}: ") and re.search(message, line), line
    assert not (tmp_path / "run").exists()


def test_a_config_built_in_python_is_told_which_sampler_to_name(sources):
    """TrainConfig built by hand is not rewritten: the check says what to name."""
    with pytest.raises(UserError, match=r"sampler completions does not read them; sampler preferences does"):
        check_config(TrainConfig(objective="dpo", loss_type="sigmoid", data=sources["plain pairs"]))


def test_dpo_trains_on_trls_standard_preference_rows_by_their_columns(sources, capsys, tmp_path):
    from tests.helpers import run_cli, train_records

    code, err = run_cli(capsys, "train", "--objective", "dpo", "--data", sources["plain pairs"], "--steps", "2",
                        "--prompts-per-step", "4", "--eval-size", "0", "--run-dir", tmp_path / "run")
    assert code == 0, err
    records = train_records(tmp_path / "run")
    assert [r["pairs"] for r in records] == [4, 4] and all(r["loss"] > 0 for r in records)


@pytest.mark.parametrize("source", ["demos", "chat demos"])
def test_sft_learns_trls_prompt_completion_rows(sources, tmp_path, source):
    """A format the built-in model never writes (the answer without working): held-out token accuracy rises."""
    cfg = build_config(None, {"objective": "sft", "data": sources[source], "steps": 10, "eval_size": 20,
                              "prompts_per_step": 16, "run_dir": str(tmp_path / "run"), "seed": 7})
    result = train(cfg, **QUIET)
    before, after = result.eval_before, result.eval_after
    assert before["n"] == after["n"] == (20 if source == "demos" else 4)  # (a tenth of the rows, at most eval_size)
    assert after["accuracy"] > before["accuracy"] + 0.1 and after["loss"] < before["loss"] / 2, (before, after)


def test_demonstration_scores_equal_a_plain_forward(builtin_model):
    """Held-out token accuracy and loss, against the model's own logits over each whole sequence."""
    from localrl.generation.rollout import Rollout, left_pad, right_pad
    from localrl.modeling import load_base, load_tokenizer
    from localrl.policy.sft import demo_scores

    model, tok = load_base(builtin_model, False, torch.device("cpu")), load_tokenizer(builtin_model)
    prompts = [tok("What is 12 + 34?")["input_ids"], tok("What is 5 + 7?")["input_ids"]]
    completions = [tok("<answer>46</answer>")["input_ids"], tok("<think>5+7=12</think><answer>12</answer>")["input_ids"]]
    prompt_ids, prompt_mask = left_pad(prompts, tok.pad_token_id)
    ids, mask = right_pad(completions, tok.pad_token_id)
    got = demo_scores(model, Rollout(prompt_ids, prompt_mask, ids, mask, torch.zeros(2, dtype=torch.bool), 1), 1)
    nll = right = n = 0
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float()
            target = torch.tensor(c)
            nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            right += (logits.argmax(-1) == target).sum().item()
            n += len(c)
    assert got["n"] == 2 and got["tokens"] == n
    assert got["loss"] == pytest.approx(nll / n, rel=1e-4) and got["accuracy"] == pytest.approx(right / n)


def test_a_source_is_typed_once_a_process(sources, monkeypatch):
    import localrl.data.dataset_types as types

    assert source_type(sources["demos"]) == "prompt_completion"
    monkeypatch.setattr(types, "raw_rows", lambda *a: pytest.fail("read again"))
    assert source_type(sources["demos"]) == "prompt_completion"
