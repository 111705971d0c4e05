"""End-to-end GRPO runs on the built-in tiny model: learning, resume equivalence, clean failures."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from localrl.config import TrainConfig
from localrl.errors import UserError
from localrl.metrics import read_metrics
from localrl.trainer import resume_config, train

TIMING_KEYS = {"tokens_per_s", "gen_s", "step_s", "wall_time", "peak_mem_mb"}  # vary run to run
QUIET = {"log": lambda *_: None}


def train_records(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS}
            for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r["kind"] == "train"]


def small(run_dir, **kw) -> TrainConfig:
    base = dict(prompts_per_step=4, group_size=4, max_new_tokens=48, eval_size=0, save_every=2,
                run_dir=str(run_dir), seed=7)
    return TrainConfig(**{**base, **kw}).validate()


def test_seeded_run_raises_reward_and_held_out_accuracy(builtin_model, tmp_path):
    cfg = small(tmp_path / "run", steps=12, prompts_per_step=8, group_size=8, eval_size=100, save_every=100)
    result = train(cfg, **QUIET)
    records = train_records(result.run_dir)
    first, last = records[:3], records[-3:]
    assert sum(r["reward_mean"] for r in last) / 3 > sum(r["reward_mean"] for r in first) / 3 + 0.1
    assert result.eval_after["accuracy"] >= result.eval_before["accuracy"] + 0.15
    # the run directory holds what the issue promises
    assert (result.run_dir / "config.toml").is_file()
    ckpt = result.run_dir / "checkpoints" / "step-000012"
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt"} <= set(os.listdir(ckpt))
    assert set(records[0]) >= {"reward_mean", "reward_std", "accuracy", "loss", "kl", "completion_len"}


def test_checkpoint_is_a_peft_adapter(builtin_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = train(small(tmp_path / "run", steps=1), **QUIET)
    base = AutoModelForCausalLM.from_pretrained(builtin_model)
    model = PeftModel.from_pretrained(base, result.run_dir / "checkpoints" / "step-000001")
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_resume_reproduces_the_uninterrupted_run(builtin_model, tmp_path):
    full = train(small(tmp_path / "full", steps=4), **QUIET)
    part = train(small(tmp_path / "part", steps=2), **QUIET)
    # a killed checkpoint write leaves only a hidden temp dir, which resume ignores and removes
    stale = part.run_dir / "checkpoints" / ".tmp-killed"
    stale.mkdir()
    (stale / "adapter_model.safetensors").write_bytes(b"half a file")
    resumed = train(resume_config(part.run_dir, {"steps": 4}), resume=True, **QUIET)
    assert not stale.exists()
    assert resumed.steps_done == 4
    assert train_records(full.run_dir) == train_records(part.run_dir)
    a = load_file(str(full.run_dir / "checkpoints" / "step-000004" / "adapter_model.safetensors"))
    b = load_file(str(part.run_dir / "checkpoints" / "step-000004" / "adapter_model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)


def test_ctrl_c_saves_and_resume_continues(builtin_model, tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "localrl.cli", "train", "--run-dir", str(run), "--steps", "40", "--eval-size", "0",
            "--prompts-per-step", "4", "--group-size", "4", "--save-every", "100", "--seed", "7",
            "--max-new-tokens", "48"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while len(train_records(run)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "interrupted: saved checkpoint" in out
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    done = len(train_records(run))
    assert ckpts == [f"step-{done:06d}"] and 2 <= done < 40
    # resume to a few steps past the interruption; the records match an uninterrupted run
    target = done + 2
    train(resume_config(run, {"steps": target}), resume=True, **QUIET)
    reference = train(small(tmp_path / "ref", steps=target, save_every=100), **QUIET)
    assert train_records(run) == train_records(reference.run_dir)


def test_corrupted_checkpoint_stops_resume_with_one_line(builtin_model, tmp_path):
    result = train(small(tmp_path / "run", steps=1), **QUIET)
    (result.run_dir / "checkpoints" / "step-000001" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="checkpoint .*step-000001: cannot be loaded"):
        train(resume_config(result.run_dir, {"steps": 2}), resume=True, **QUIET)


def test_bad_data_stops_before_a_run_directory_exists(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": 2}\n{"prompt": "2+2?", "answer": 4\n')
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"d\.jsonl:2: invalid JSON"):
        train(small(run, steps=1, data=str(data)), **QUIET)
    assert not run.exists()


def test_user_jsonl_task_trains(builtin_model, tmp_path):
    rows = [{"prompt": f"What is {a} + {b}?", "answer": a + b, "source": "file"} for a in range(10, 40, 3)
            for b in range(5, 30, 4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []

    def source_reward(completions, source, answer, prompt, **_):
        seen.extend(source)
        return [0.0] * len(completions)

    result = train(small(tmp_path / "run", steps=1, data=str(data), eval_size=5),
                   rewards=([source_reward], [1.0]), **QUIET)
    assert set(seen) == {"file"} and result.eval_before["n"] == 5
