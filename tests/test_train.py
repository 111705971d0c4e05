"""End-to-end GRPO runs on the built-in tiny model: learning, resume equivalence, clean failures."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from localrl.config import TrainConfig
from localrl.errors import UserError
from localrl.metrics import read_metrics
from localrl.runs import Run
from localrl.training.loop import resume_config, train
from tests.helpers import QUIET, small, train_records

@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_resume_with_lora_dropout_reproduces_the_uninterrupted_run(builtin_model, tmp_path):
    """Dropout draws from torch's global generator in every update: only a checkpoint that restores that
    generator's state lets a resumed run repeat the uninterrupted one (with dropout 0 nothing draws from it)."""
    dropout = {"lora_dropout": 0.1, "save_every": 1, "prompts_per_step": 2, "max_new_tokens": 16,
               "reward": "tests.helpers:distinct_chars"}  # groups with a signal from the first step on
    full = train(small(tmp_path / "full", steps=2, **dropout), **QUIET)
    train(small(tmp_path / "part", steps=1, **dropout), **QUIET)
    train(resume_config(tmp_path / "part", {"steps": 2}), resume=True, **QUIET)
    records = train_records(full.run_dir)
    assert train_records(tmp_path / "part") == records and all(r["frac_reward_zero_std"] < 1 for r in records)
    a = load_file(str(full.run_dir / "checkpoints" / "step-000002" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "part" / "checkpoints" / "step-000002" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


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
    # sums with carries, which the built-in model gets right only some of the time
    rows = [{"prompt": f"What is {a} + {b}?", "answer": a + b, "source": "file"} for a in range(15, 99, 7)
            for b in range(17, 99, 9)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []

    def answer_reward(completions, source, answer, prompt, **_):
        """Every column arrives aligned with the completions; right answers score (the built-in model
        often forgets a carry), and length breaks ties, so the score varies within a step."""
        seen.extend(source)
        assert len(answer) == len(prompt) == len(completions)
        for a, p in zip(answer, prompt):  # rows stay aligned: each answer belongs to its own prompt
            x, y = map(int, re.findall(r"\d+", p))
            assert x + y == a
        return [float(f"<answer>{a}</answer>" in c) + len(c) / 1000 for c, a in zip(completions, answer)]

    result = train(small(tmp_path / "run", steps=2, data=str(data), eval_size=5),
                   rewards=([answer_reward], [1.0]), **QUIET)
    assert set(seen) == {"file"} and result.eval_before["n"] == 5
    records = train_records(result.run_dir)
    assert all(r["reward_std"] > 0 for r in records)  # a reward that varies: there is something to learn
    adapter = load_file(str(Run(result.run_dir).latest_checkpoint() / "adapter_model.safetensors"))
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero: it moved


def test_a_saved_checkpoint_restores_the_trained_adapter_exactly(builtin_model, tmp_path):
    """Save after two real steps, restore into a freshly loaded policy: the same adapter weights, the
    same logits, the same optimizer state (and a fresh policy's logits differ, so the check has teeth)."""
    import torch

    from localrl.data import load_task
    from localrl.data.rewards import default_rewards
    from localrl.generation.rollout import stop_token_ids
    from localrl.modeling import load_policy, pick_device
    from localrl.objectives.grpo import step_on_task

    cfg = small(tmp_path / "run", steps=2)
    device = pick_device("cpu")
    task = load_task(cfg.data, eval_size=0)
    rewards, weights = default_rewards(cfg.reward, cfg.format_weight)

    def fresh():
        torch.manual_seed(cfg.seed)
        model, tok = load_policy(cfg, device)
        return model, tok, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)

    model, tok, optimizer = fresh()
    for step in range(2):
        step_on_task(model, tok, optimizer, task, step, cfg, rewards, weights, stop_token_ids(tok, model))
    run = Run(tmp_path / "run")
    run.save_checkpoint(2, model, optimizer)

    probe = torch.tensor([tok("What is 457 + 68?")["input_ids"]])
    model.eval()
    with torch.no_grad():
        trained_logits = model(probe).logits
    restored, _, restored_optimizer = fresh()
    with torch.no_grad():
        assert not torch.allclose(restored.eval()(probe).logits, trained_logits)
    assert run.restore(restored, restored_optimizer, log=lambda *_: None) == 2
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for name, p in restored.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, trained[name]), name
    with torch.no_grad():
        assert torch.equal(restored(probe).logits, trained_logits)
    state, restored_state = optimizer.state_dict()["state"], restored_optimizer.state_dict()["state"]
    assert state.keys() == restored_state.keys()
    assert all(torch.equal(state[k]["exp_avg"], restored_state[k]["exp_avg"]) for k in state)


def test_a_run_without_a_learning_signal_says_so(builtin_model, tmp_path):
    def never(completions, **_):
        return [0.0] * len(completions)

    lines = []
    result = train(small(tmp_path / "run", steps=4, format_weight=0.0), rewards=([never], [1.0]), log=lines.append)
    warnings = [r for r in read_metrics(Run(result.run_dir).metrics_path) if r["kind"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["step"] == 3  # once, after three flat steps
    assert "no learning signal for 3 steps: every completion failed" in warnings[0]["message"]
    assert any(line.startswith("warning: no learning signal") for line in lines)
    assert all(r["frac_reward_zero_std"] == 1.0 for r in train_records(result.run_dir))


def test_every_group_solved_is_said_as_progress_not_as_a_warning(builtin_model, tmp_path):
    def always(completions, **_):
        return [1.0] * len(completions)

    lines = []
    result = train(small(tmp_path / "run", steps=3, format_weight=0.0), rewards=([always], [1.0]), log=lines.append)
    records = read_metrics(Run(result.run_dir).metrics_path)
    assert not [r for r in records if r["kind"] == "warning"]
    [note] = [r for r in records if r["kind"] == "note"]
    assert note["step"] == 3 and note["message"].startswith("every group solved for 3 steps")
    assert not any("warning" in line for line in lines) and any(line.startswith("every group solved") for line in lines)


def test_groups_alike_but_not_all_solved_point_at_cold_sampling(builtin_model, tmp_path):
    def by_prompt(completions, answer, **_):  # the same within a group, different between groups
        return [float(int(a) % 2 == 0) for a in answer]

    result = train(small(tmp_path / "run", steps=3, format_weight=0.0), rewards=([by_prompt], [1.0]), log=QUIET["log"])
    [warning] = [r for r in read_metrics(Run(result.run_dir).metrics_path) if r["kind"] == "warning"]
    assert "some tasks are always solved and the others never" in warning["message"]
    assert "temperature 1" in warning["message"]


def test_eval_shows_sample_completions_with_their_rewards(builtin_model):
    from localrl.commands.eval import evaluate_policy

    result = evaluate_policy(TrainConfig(eval_size=6, eval_batch_size=6).validate(), samples=2)
    assert result["n"] == 6 and len(result["samples"]) == 2
    sample = result["samples"][0]
    assert sample["prompt"].startswith("What is") and "<answer>" in sample["completion"]
    assert set(sample["rewards"]) == {"numeric_match", "format_reward"}


@pytest.mark.slow
def test_llama_cpp_rollouts_are_corrected_and_resume_like_an_uninterrupted_run(builtin_model, tmp_path):
    """The llama.cpp backend (auto on a CPU with llama-cpp-python): its samples are the torch policy's to
    within f16 rounding (importance weights near 1), a resumed run repeats an uninterrupted one, and its
    held-out evaluation (decoded by llama.cpp, in batches of at most its 16 rows) is torch's."""
    from localrl.commands.eval import evaluate_policy

    full = train(small(tmp_path / "full", steps=4, rollout="llama.cpp", eval_size=20), **QUIET)
    part = train(small(tmp_path / "part", steps=2, rollout="llama.cpp"), **QUIET)
    train(resume_config(part.run_dir, {"steps": 4}), resume=True, **QUIET)
    records = train_records(full.run_dir)
    assert records == train_records(part.run_dir)
    assert all(0.9 < r["is_weight"] <= 1.1 for r in records)
    status = next(r for r in read_metrics(Run(full.run_dir).metrics_path) if r["kind"] == "status")
    assert "rollouts: llama.cpp" in status["message"]
    by_torch = evaluate_policy(small(tmp_path / "unused", eval_size=20, rollout="torch"), run=full.run_dir, samples=0)
    assert full.eval_after["accuracy"] == by_torch["accuracy"] and full.eval_after["n"] == 20
    assert full.eval_after["reward_mean"] == pytest.approx(by_torch["reward_mean"])


def signal_on_odd_answers(completions, answer, **_):
    """A reward with a learning signal only for prompts whose answer is odd (every other group is flat)."""
    return [float(i % 2) if int(a) % 2 else 1.0 for i, a in enumerate(answer)]


def test_dynamic_sampling_fills_the_batch_with_groups_that_have_a_signal(builtin_model, tmp_path):
    rewards = ([signal_on_odd_answers], [1.0])
    plain = train(small(tmp_path / "plain", steps=2, model=str(builtin_model)), rewards=rewards, **QUIET)
    dynamic = small(tmp_path / "dyn", steps=2, model=str(builtin_model), dynamic_sampling=True,
                    dynamic_sampling_rounds=4)
    train(dynamic, rewards=rewards, **QUIET)
    plain_records, records = train_records(plain.run_dir), train_records(tmp_path / "dyn")
    assert all(r["frac_reward_zero_std"] > 0 for r in plain_records)  # flat groups in the ordinary batch
    for r in records:  # more prompts sampled, up to the cap, until every trained group has a signal
        assert 4 < r["sampled_prompts"] <= 4 * 5
        assert r["frac_reward_zero_std"] == 0
    # reproducible from (seed, step): a second run is the same
    train(small(tmp_path / "again", steps=2, model=str(builtin_model), dynamic_sampling=True,
                dynamic_sampling_rounds=4), rewards=rewards, **QUIET)
    assert train_records(tmp_path / "again") == records


@pytest.fixture(scope="module")
def four_grpo_steps(builtin_model, tmp_path_factory):
    """The first 4 steps of the loss-type runs: every loss gives these alike (at ratio 1 their gradients differ only
    in scale, which Adam's first steps do not see; measured, the 8 losses' rewards were equal to 3 decimals through
    step 4 and parted from step 5), so each loss starts from this checkpoint."""
    run = tmp_path_factory.mktemp("losses") / "grpo"
    train(small(run, steps=4, prompts_per_step=8, group_size=8, save_every=100, num_iterations=2), **QUIET)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_every_loss_type_trains_the_built_in_model(four_grpo_steps, tmp_path, loss_type):
    """Seeded steps 5-8 with each loss, off-policy on their second pass (num_iterations 2): the reward of the last 3
    steps rises over the first 3, no NaN (measured, steps 6-8 over 1-3: 0.67 -> 0.77-1.01)."""
    extra = {"cispo": {"epsilon_high": 5.0}}.get(loss_type, {})
    run = tmp_path / "run"
    shutil.copytree(four_grpo_steps, run)
    train(resume_config(run, {"run_dir": str(run), "steps": 8, "loss_type": loss_type, **extra}), resume=True,
          **QUIET)
    records = train_records(run)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward_mean"]) for r in records)
    mean = lambda rs: sum(r["reward_mean"] for r in rs) / len(rs)  # noqa: E731
    assert mean(records[-3:]) > mean(records[:3]) + 0.05, [round(r["reward_mean"], 3) for r in records]


@pytest.mark.slow
def test_reference_sync_makes_the_kl_zero_right_after_it_and_resumes_exactly(builtin_model, tmp_path):
    import torch

    sync = {"beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 1.0,
            "reset_optimizer_on_sync": True, "save_every": 1}
    train(small(tmp_path / "full", steps=4, **sync), **QUIET)
    records = train_records(tmp_path / "full")
    assert [bool(r.get("ref_synced")) for r in records] == [False, True, False, True]
    assert records[1]["kl"] > 0  # by step 2 the policy has moved away from the base
    assert records[2]["kl"] == 0.0  # right after a hard sync the reference is the policy
    # the optimizer was reset at the sync after step 2: step 3's checkpoint holds one AdamW step
    state = torch.load(tmp_path / "full" / "checkpoints" / "step-000003" / "trainer_state.pt", weights_only=False)
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {1}
    # a run stopped after the first sync and resumed holds the synced reference and goes on identically
    train(small(tmp_path / "part", steps=3, **sync), **QUIET)
    train(resume_config(tmp_path / "part", {"steps": 4}), resume=True, **QUIET)
    assert train_records(tmp_path / "part") == records


@pytest.mark.slow
def test_adaptive_entropy_control_raises_its_coefficient_below_the_target_and_resumes_exactly(tmp_path):
    adaptive = {"use_adaptive_entropy": True, "entropy_target": 50.0, "entropy_coef_delta": 0.01,
                "entropy_coef_max": 0.025, "save_every": 1}
    train(small(tmp_path / "full", steps=4, **adaptive), **QUIET)
    records = train_records(tmp_path / "full")
    # no bonus before the first measurement; then +delta after each step whose entropy was below the target
    assert [r["entropy_coef"] for r in records] == pytest.approx([0.0, 0.01, 0.02, 0.025])
    assert all(0 < r["entropy"] < 50 for r in records)
    train(small(tmp_path / "part", steps=2, **adaptive), **QUIET)
    train(resume_config(tmp_path / "part", {"steps": 4}), resume=True, **QUIET)
    assert train_records(tmp_path / "part") == records


def test_truncated_completions_can_be_left_out_of_a_single_turn_loss(tmp_path):
    """With 2 new tokens every completion is cut off: masked, the adapter never moves."""
    train(small(tmp_path / "run", steps=1, max_new_tokens=2, mask_truncated_completions=True,
                reward="tests.test_train:signal_on_odd_answers"), **QUIET)
    [record] = train_records(tmp_path / "run")
    assert record["truncated"] == 1.0 and record["frac_reward_zero_std"] < 1
    adapter = load_file(str(tmp_path / "run" / "checkpoints" / "step-000001" / "adapter_model.safetensors"))
    assert all((v == 0).all() for k, v in adapter.items() if "lora_B" in k)


@pytest.mark.slow
def test_a_run_with_less_free_memory_than_configured_plans_smaller_and_says_so(builtin_model, tmp_path, monkeypatch):
    """Without memory_budget the budget is the free memory: a step that does not fit it as configured is
    planned smaller (rollouts a few prompts at a time, the update in micro-batches), said in the run's first
    lines, and learns the same (the same completions, the same loss to float rounding). With less free than
    the smallest plan needs, one line before any weight loads names the least that would do."""
    cfg = dict(steps=1, prompts_per_step=8, group_size=8, save_every=1, rollout="torch")
    monkeypatch.setenv("LOCALRL_FREE_MEMORY", "100MB")  # standing in for a machine with little free
    with pytest.raises(UserError, match=r"cannot hold .* needs a budget of at least [0-9.]+ GiB") as refused:
        train(small(tmp_path / "none", **cfg), log=QUIET["log"])
    assert not (tmp_path / "none").exists()
    least = float(re.search(r"at least ([0-9.]+) GiB", str(refused.value)).group(1))
    monkeypatch.delenv("LOCALRL_FREE_MEMORY")
    roomy = train(small(tmp_path / "roomy", **cfg), log=QUIET["log"])
    lines = []
    monkeypatch.setenv("LOCALRL_FREE_MEMORY", f"{(least + 0.01) / 0.9:.3f}GB")  # just more than the least, after the margin
    tight = train(small(tmp_path / "tight", **cfg), log=lines.append)
    [plan_line] = [line for line in lines if line.startswith("memory: to fit the budget")]
    at_once = int(re.search(r"rollouts (\d+) prompts? at a time \(of 8\)", plan_line).group(1))
    micro_batch = int(re.search(r"micro-batches of (\d+) completions?", plan_line).group(1))
    assert at_once < 8 and micro_batch < 64
    [note] = [r for r in read_metrics(Run(tight.run_dir).metrics_path) if r["kind"] == "note"]
    assert note["message"] == plan_line
    [a], [b] = train_records(roomy.run_dir), train_records(tight.run_dir)
    # planned for the longest prompt and max_new_tokens; a batch of shorter completions gets at least as many
    assert a["micro_batch"] == 64 and micro_batch <= b["micro_batch"] < 64
    assert a["reward_mean"] == b["reward_mean"] and a["completion_len"] == b["completion_len"]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
