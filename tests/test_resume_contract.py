"""The resume contract, over the registries: for every registered objective, sampler and environment, a run of 3
steps and the same run stopped after its second checkpoint and resumed record the same steps and end with the same
adapters (2 prompts, G=4, 16 tokens; 48 for episodes). Each case is a config a user could write; together they
select every registered plug-in, and a plug-in registered without a case here fails
`test_the_cases_select_every_registered_plugin`.

The contract is what every plug-in owes; each plug-in's own file tests what resuming means for it beyond this (an
experience library, two adapters taking turns, llama.cpp's rollouts, a reference sync, dropout's generator,
torchrun's ranks, a Ctrl-C, a kill -9)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from localrl.envs import environments
from localrl.objectives import objectives
from localrl.samplers import samplers
from localrl.training.loop import resume_config, train
from localrl.training.settings import build_config
from tests.helpers import QUIET, make_tiny_model, record_sessions, train_records, write_demonstrations, write_pairs

BASE = {"steps": 3, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 16, "eval_size": 0, "save_every": 1,
        "seed": 7}
SIGNAL = {"reward": "tests.helpers:distinct_chars"}  # completions of a group score apart from the first step on
EPISODES = {"max_new_tokens": 48, "temperature": 1.5}  # long and varied enough that a group's episodes score apart
# (name: fields); "{long}", "{pairs}", "{demos}", "{sessions}": files the `files` fixture makes
CASES = {
    "grpo": SIGNAL,
    "dpo online": {"objective": "dpo", **SIGNAL},
    "dpo from a file": {"objective": "dpo", "data": "{pairs}"},  # (the pairs' columns select sampler preferences)
    "ppo": {"objective": "ppo", "num_ppo_epochs": 2, **SIGNAL},
    "contrastive_grpo": {"objective": "contrastive_grpo", "contrastive_margin": 0.1, **SIGNAL},
    "experience": {"objective": "experience", "experience_judge": "{long}", "experience_judge_tokens": 8, **SIGNAL},
    "markovian": {"markovian_chunk": 8, "markovian_carry": 4, **SIGNAL},
    "plan_then_act": {"sampler": "plan_then_act", "plan_count": 2, "plan_tokens": 8, **SIGNAL},
    "prefix_tree": {"sampler": "prefix_tree", "tree_prefixes": 2, **SIGNAL},
    "shell": {"env": "shell", **EPISODES},
    "sft": {"objective": "sft", "env": "shell"},
    "sft from a file": {"objective": "sft", "data": "{demos}"},  # (prompt-completion rows: sampler demonstrations)
    "turn_grpo": {"objective": "turn_grpo", "env": "shell", **EPISODES},
    "shell_drafts": {"objective": "sft", "env": "shell_drafts"},
    "shell_person": {"env": "shell_person", "person_sessions": "{sessions}", **EPISODES},
    "world": {"env": "world:tiny-shell-world", **EPISODES},
    "secret_keeping": {"env": "secret_keeping", "turn_tokens": 8, "model": "{long}"},  # (its prompts: 250 tokens)
}
# Cases whose weights do not move, and why (every other case's adapters must: a contract on weights that stay at
# LoRA's zero would hold whatever resume did to the optimizer)
STILL = {"experience": "training-free: it learns lessons, not weights (its library's resume: tests/test_experience.py)",
         "secret_keeping": "a random model neither leaks the password nor answers the control question: every game "
                           "scores 0 (two adapters that move and resume: tests/test_self_play.py's lengths game)"}


@pytest.fixture(scope="module")
def files(tmp_path_factory, builtin_model) -> dict[str, str]:
    """What some cases name: a random model with a context of 2048 tokens (a judge, a game's players), a TRL
    preference file, a TRL prompt-completion file, a person's recorded sessions."""
    root = tmp_path_factory.mktemp("contract")
    return {"long": str(make_tiny_model(root / "long", "llama", context=2048)),
            "pairs": write_pairs(root / "pairs.jsonl", 40),
            "demos": write_demonstrations(root / "demos.jsonl", 40),
            "sessions": str(record_sessions(root, "long-options", n=4))}


def config(case: str, files: dict[str, str], run_dir: Path, **over):
    fields = {k: v.format(**files) if isinstance(v, str) else v for k, v in CASES[case].items()}
    return build_config(None, {**BASE, **fields, "run_dir": str(run_dir), **over})


def adapters(run_dir: Path) -> dict[str, dict]:
    """Every adapter file of the run's last checkpoint (a game's second player in a folder of its own)."""
    last = max((run_dir / "checkpoints").iterdir())
    return {str(p.relative_to(last)): load_file(str(p)) for p in sorted(last.rglob("*.safetensors"))}


def test_the_cases_select_every_registered_plugin(files, tmp_path):
    chosen = {"objective": set(), "sampler": set(), "environment": set()}
    for case in CASES:
        cfg = config(case, files, tmp_path / "unused")
        chosen["objective"].add(objectives.selected(cfg))
        chosen["sampler"].add(samplers.selected(cfg))
        chosen["environment"].add(environments.selected(cfg).partition(":")[0])
    assert chosen["objective"] == set(objectives.names())
    assert chosen["sampler"] == set(samplers.names())
    assert chosen["environment"] - {""} == set(environments.names())


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_run_stopped_after_2_of_3_steps_and_resumed_equals_the_uninterrupted_run(case, files, tmp_path):
    whole = train(config(case, files, tmp_path / "whole"), **QUIET).run_dir

    def killed_after_checkpoint_2(record):  # (the same run of 3 steps: a schedule over the run's steps is the same)
        if record.get("kind") == "checkpoint" and record["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(config(case, files, tmp_path / "part"), listeners=[killed_after_checkpoint_2], **QUIET)
    resumed = train(resume_config(tmp_path / "part", {}), resume=True, **QUIET)
    assert resumed.steps_done == 3
    records = train_records(whole)
    assert [r["step"] for r in records] == [1, 2, 3] and train_records(tmp_path / "part") == records
    a, b = adapters(whole), adapters(tmp_path / "part")
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].keys() == b[name].keys() and all((a[name][k] == b[name][k]).all() for k in a[name]), name
    moved = any(bool(v.any()) for weights in a.values() for k, v in weights.items() if "lora_B" in k)
    assert moved == (case not in STILL), STILL.get(case, "the adapters never moved: the case trains nothing")
