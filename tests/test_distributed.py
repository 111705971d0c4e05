"""Data-parallel training under torchrun, on this CPU with gloo: the update of 2 ranks equals one process's
on both ranks' groups, 2 ranks x B prompts train like 1 process x 2B, rank 0 alone writes, a killed 2-rank
run resumes like an uninterrupted one, and a world of one is the single-process path exactly."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from localrl.data import load_task
from localrl.distributed import World, init_from_env, pool_records
from localrl.generation.rollout import concat_rollouts, encode_prompts, sample_groups
from localrl.metrics import read_metrics
from localrl.modeling import load_policy
from localrl.policy.grpo import update
from localrl.runs import ADAPTER_FILE, Run
from localrl.training.loop import train
from tests.helpers import QUIET, small, train_records

WORKER = Path(__file__).with_name("distributed_worker.py")


def _torchrun(nproc: int, *args, wait: bool = True, timeout: float = 300, ok: bool = True):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *map(str, args)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a kill reaches every rank
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=timeout)
    assert (proc.returncode == 0) == ok, out[-3000:]
    return out


def _train_args(run_dir, **fields) -> list[str]:
    base = {"run-dir": run_dir, "eval-size": 0, "group-size": 4, "max-new-tokens": 48, "seed": 7, "rollout": "torch",
            "save-every": 1, **fields}
    return ["-m", "localrl", "train", *(x for k, v in base.items() for x in (f"--{k}", v))]


def _adapter(run_dir) -> dict[str, torch.Tensor]:
    return load_file(Run(run_dir).latest_checkpoint() / ADAPTER_FILE)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= atol, k


# -- without a launch ------------------------------------------------------------------------


def test_the_pooled_record_is_the_record_of_the_whole_batch():
    rng = random.Random(0)
    rewards = [[rng.choice([0.0, 0.2, 1.0, 1.2]) for _ in range(n)] for n in (8, 12)]

    def record(rs: list[float]) -> dict:
        t = torch.tensor(rs, dtype=torch.float64)
        return {"kind": "train", "step": 1, "completions": len(rs), "reward_mean": t.mean().item(),
                "reward_std": t.std().item(), "accuracy": sum(r >= 1 for r in rs) / len(rs),
                "rewards": {"match": sum(r >= 1 for r in rs) / len(rs)}, "loss": 0.5, "step_s": len(rs) / 10,
                "tokens_per_s": 100.0, "allreduce_s": len(rs) / 100}

    whole, pooled = record(sum(rewards, [])), pool_records([record(r) for r in rewards])
    for key in ("completions", "reward_mean", "reward_std", "accuracy", "loss"):
        assert pooled[key] == pytest.approx(whole[key], rel=1e-12), key
    assert pooled["rewards"]["match"] == pytest.approx(whole["rewards"]["match"])
    assert (pooled["step_s"], pooled["tokens_per_s"], pooled["allreduce_s"]) == (1.2, 200.0, 0.08)


def test_a_world_of_one_is_a_single_process_and_its_collectives_do_nothing():
    assert init_from_env({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}) == World()
    assert init_from_env({}) == World()
    w = World()
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    assert w.all_reduce_gradients([p]) == 0.0 and p.grad.tolist() == [2.0] * 3
    assert (w.sum(1, 2.5), w.gather("x"), w.broadcast(7), w.shard(4)) == ((1.0, 2.5), ["x"], 7, slice(0, 4))
    assert World(1, 2).shard(4) == slice(4, 8)


# -- launched by torchrun --------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_update_like_one_process_on_both_ranks_groups_and_hold_equal_gradients(builtin_model, tmp_path):
    """Per case: each rank updates on its own groups; their gradients after the all-reduce are identical, and
    the adapter equals one process's update on all the groups (rows- and token-normalised losses, a rank whose
    groups all scored alike, batch-scaled advantages, micro-batches, the step-wide entropy quantile)."""
    # no gradient clipping: the gradients are compared as they come out of the all-reduce
    cases_cfg = [dict(loss_type="grpo", beta=0.04, max_grad_norm=0),
                 dict(loss_type="dapo", beta=0.0, micro_batch_size=3, max_grad_norm=0),
                 dict(loss_type="dr_grpo", beta=0.0, scale_rewards="batch", top_entropy_quantile=0.5, max_grad_norm=0)]
    rewards = [torch.tensor([1.0, 0, 0, 1, 0, 0, 1, 1], dtype=torch.float64),
               torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0], dtype=torch.float64)]  # rank 1: both groups flat
    cases = []
    for kw in cases_cfg:
        cfg = small(tmp_path / "unused", group_size=4, prompts_per_step=2, **kw)
        torch.manual_seed(cfg.seed)
        model, tok = load_policy(cfg, torch.device("cpu"), in_4bit=False)
        task = load_task(cfg.data, cfg.eval_data, 0)
        prompts = encode_prompts(tok, task.sample(0, 4, cfg.seed), task.system)
        g = torch.Generator().manual_seed(1)
        rollouts = [sample_groups(model, prompts[2 * r:2 * r + 2], 4, 24, [tok.eos_token_id], tok.pad_token_id, 1.0, g)
                    for r in range(2)]
        cases.append({"cfg": cfg, "rollouts": rollouts, "rewards": rewards})
    torch.save(cases, tmp_path / "cases.pt")
    _torchrun(2, WORKER, tmp_path / "cases.pt", tmp_path)
    for i, case in enumerate(cases):
        cfg = case["cfg"]
        torch.manual_seed(cfg.seed)
        model, tok = load_policy(cfg, torch.device("cpu"), in_4bit=False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                      weight_decay=cfg.weight_decay)
        stats = update(model, optimizer, concat_rollouts(case["rollouts"], tok.pad_token_id), torch.cat(rewards), cfg, 0)
        ranks = [torch.load(tmp_path / f"case-{i}-rank-{r}.pt") for r in range(2)]
        for name in ranks[0]["grads"]:
            assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
            assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        for name, p in trainable.items():  # the sum of the ranks' gradients is the gradient of the whole batch
            scale = p.grad.abs().max().item()  # (0 for lora_A at the first step: lora_B starts at 0)
            assert (p.grad - ranks[0]["grads"][name]).abs().max().item() <= 1e-4 * scale, name
        assert max(p.grad.abs().max().item() for p in trainable.values()) > 0
        _close({n: p.detach() for n, p in trainable.items()}, ranks[0]["weights"], atol=1e-6)
        assert ranks[0]["stats"]["loss"] == pytest.approx(stats["loss"], rel=1e-4, abs=1e-9), cfg.loss_type
        assert ranks[0]["stats"]["clip_frac"] == pytest.approx(stats["clip_frac"], abs=1e-9)


@pytest.fixture(scope="module")
def two_ranks(builtin_model, tmp_path_factory) -> Path:
    """A 3-step run of 2 ranks x 2 prompts (the killed run's uninterrupted twin too)."""
    two = tmp_path_factory.mktemp("two-ranks") / "two"
    out = _torchrun(2, *_train_args(two, steps=3, **{"prompts-per-step": 2}))
    assert out.count("run: ") == 1  # rank 0 reports
    return two


@pytest.mark.slow
def test_two_ranks_train_like_one_process_with_both_ranks_prompts_and_rank_0_alone_writes(builtin_model, tmp_path,
                                                                                          two_ranks):
    one = tmp_path / "one"  # a world of one, launched by torchrun: exactly the single-process run
    _torchrun(1, *_train_args(one, steps=3, **{"prompts-per-step": 4}))
    plain = train(small(tmp_path / "plain", steps=3, save_every=1, rollout="torch"), **QUIET)
    assert train_records(one) == train_records(plain.run_dir)
    assert all(torch.equal(a, b) for a, b in zip(_adapter(one).values(), _adapter(plain.run_dir).values()))

    two = two_ranks
    records, reference = train_records(two), train_records(one)
    equal_keys = ("step", "completions", "reward_mean", "accuracy", "rewards", "completion_len", "truncated",
                  "frac_reward_zero_std")
    assert [{k: r[k] for k in equal_keys} for r in records] == [{k: r[k] for k in equal_keys} for r in reference]
    for r, ref in zip(records, reference):
        assert r["reward_std"] == pytest.approx(ref["reward_std"], rel=1e-12)
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-3, abs=1e-8)
    # Adam moves an element by about lr (2e-3) a step; the ranks' other summation order, by far less
    _close(_adapter(two), _adapter(one), atol=2e-5)
    # one writer: the files of a run, one record per step and one checkpoint record per save
    assert sorted(p.name for p in two.iterdir()) == [".lock", "base.json", "checkpoints", "config.toml",
                                                     "metrics.jsonl"]  # (.lock: rank 0's hold on the directory)
    kinds = [r["kind"] for r in read_metrics(Run(two).metrics_path)]
    assert (kinds.count("train"), kinds.count("checkpoint")) == (3, 3)
    assert all(r["allreduce_s"] >= 0 for r in read_metrics(Run(two).metrics_path) if r["kind"] == "train")


@pytest.mark.slow
def test_a_killed_two_rank_run_resumes_like_an_uninterrupted_one(builtin_model, tmp_path, two_ranks):
    whole = two_ranks
    run = tmp_path / "run"
    proc = _torchrun(2, *_train_args(run, steps=3, **{"prompts-per-step": 2}), wait=False)
    target, deadline = 2, time.monotonic() + 240
    while len(train_records(run) if (run / "metrics.jsonl").exists() else []) < target:
        assert proc.poll() is None, "the run ended before the moment to kill it"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks, no handler runs
    proc.wait()
    done = Run(run).steps_done()
    assert 1 <= done < 3
    _torchrun(2, "-m", "localrl", "train", "--resume", run)
    assert train_records(run) == train_records(whole)
    assert all(torch.equal(a, b) for a, b in zip(_adapter(run).values(), _adapter(whole).values()))


@pytest.mark.slow
def test_a_problem_rank_0_finds_before_training_stops_every_rank_with_one_line(builtin_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n{"prompt": "no answer"\n')
    out = _torchrun(2, *_train_args(tmp_path / "run", steps=1, data=bad), ok=False)
    errors = [line for line in out.splitlines() if line.startswith("localrl: error:")]
    assert len(errors) == 1 and f"{bad}:2" in errors[0], out[-3000:]
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.slow
def test_ctrl_c_under_torchrun_saves_a_checkpoint_every_rank_agrees_on(builtin_model, tmp_path):
    run = tmp_path / "run"
    proc = _torchrun(2, *_train_args(run, steps=40, **{"prompts-per-step": 2, "save-every": 100}), wait=False)
    deadline = time.monotonic() + 240
    while len(train_records(run) if (run / "metrics.jsonl").exists() else []) < 2:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: torchrun and both ranks
    out, _ = proc.communicate(timeout=120)
    done = Run(run).steps_done()
    assert 2 <= done < 40 and f"saved checkpoint at step {done}" in out, out[-3000:]
    assert len(train_records(run)) == done
