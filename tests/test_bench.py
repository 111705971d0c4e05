"""The benchmarks: every `localrl bench` command runs at a tiny size and prints its ratios (as a user runs it,
in a subprocess), and grpo-step's prompts have exactly the requested token count. Smoke tests, never timings."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from localrl.benchmarks.grpo_step import exact_length_prompts
from localrl.cli import main
from localrl.generation.rollout import encode_prompts
from localrl.models.pretraining import build_tokenizer

TINY = ["--model-size", "tiny", "--prompt-len", "12", "--completion-len", "6", "--group", "2", "--repeats", "1"]


def bench(*args, env=None) -> subprocess.CompletedProcess:
    """``python -m localrl bench ARGS``."""
    return subprocess.run([sys.executable, "-m", "localrl", "bench", *args], capture_output=True, text=True,
                          timeout=240, env=env)


def numbers(*texts: str) -> list[float]:
    values = [float(t) for t in texts]
    assert all(math.isfinite(v) for v in values), texts
    return values


def json_line(stdout: str):
    return json.loads(stdout.strip().splitlines()[-1])  # --json prints last, after any library's log lines


# -- grpo-step's prompts ----------------------------------------------------------------------

@pytest.mark.parametrize("length", [1, 2, 7, 64, 300, 1000])
def test_prompts_have_exactly_the_requested_tokens(length):
    tok = build_tokenizer()
    tok.chat_template = None  # as the bench's model has it: raw-text prompts
    prompts = exact_length_prompts(tok, length, count=4)
    assert len(set(prompts)) == 4
    assert [len(tok(p)["input_ids"]) for p in prompts] == [length] * 4  # how TRL encodes them
    assert [len(ids) for ids in encode_prompts(tok, [{"prompt": p} for p in prompts])] == [length] * 4  # localrl


def test_prompts_survive_the_tokenizer_being_saved_and_loaded(tmp_path):
    from localrl.modeling import load_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))  # the bench measures with the tokenizer both trainers load
    assert [len(tok(p)["input_ids"]) for p in exact_length_prompts(tok, 500, count=3)] == [500] * 3


def test_why_prompts_are_built_from_tokens():
    """The regression: the built-in tokenizer's merges make random letters fewer tokens than characters."""
    tok = build_tokenizer()
    assert len(tok("as is")["input_ids"]) < len("as is")


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_prompts_are_exact_for_other_tokenizers(tmp_path, kind):
    """Many merges (a trained BPE), or a tokenizer that adds a BOS itself (SentencePiece, Llama 2 style)."""
    from tests.helpers import train_bpe_tokenizer, train_spm_tokenizer

    tok = train_bpe_tokenizer() if kind == "bpe" else train_spm_tokenizer(tmp_path)
    for length in (3, 50, 400):
        assert [len(tok(p)["input_ids"]) for p in exact_length_prompts(tok, length, count=2)] == [length] * 2


def test_a_length_below_the_tokenizers_own_specials_is_a_user_error(tmp_path):
    from localrl.errors import UserError
    from tests.helpers import train_spm_tokenizer

    with pytest.raises(UserError, match="adds 1 special token"):
        exact_length_prompts(train_spm_tokenizer(tmp_path), 1, count=1)  # the BOS alone is one token


# -- bad flags: one line, before any work ------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["export", "--quant", "q8_0", "--quant", "q4_k_m,q9"], "unknown quant type(s) q9; known: f32"),
    (["export", "--prompt-len", "8"], "bench export: --prompt-len is for bench prompt-cache, grpo-step, memory and "
                                      "utilisation (see localrl bench export -h)"),
    (["export", "--model-size", "tiny"], "bench export: --model-size is for bench prompt-cache, grpo-step and "
                                         "utilisation"),
    (["prompt-cache", "--quant", "q8_0"], "bench prompt-cache: --quant is for bench export"),
    (["prompt-cache", "--group", "1"], "shape P=1000 R=100 G=1: need P, R >= 1 and G >= 2"),
    (["distributed", "--prompt-len", "8"], "bench distributed: --prompt-len is for bench prompt-cache"),
    (["distributed", "--prompts", "0"], "bench distributed: need --prompts >= 1"),
    (["memory", "--group", "1"], "bench memory: need --group >= 2"),
    (["memory", "--sessions", "5"], "bench memory: --sessions is for bench approvals"),
    (["memory", "--budget", "5XB"], "bench memory: --budget is for --model"),
    (["rollout", "--learn", "rl"], "bench rollout: --learn is for bench approvals"),
    (["memory", "--held-out", "5"], "bench memory: --held-out is for bench approvals and world"),
    (["world", "--group", "4"], "bench world: --group is for bench prompt-cache, grpo-step, rollout"),
    (["world", "--held-out", "0"], "bench world: need --held-out >= 1"),
    (["world", "--held-out", "x"], "bench world: argument --held-out: invalid int value: 'x'"),
    (["approvals", "--group", "4"], "bench approvals: --group is for bench"),
    (["approvals", "--held-out", "0"], "bench approvals: need --sessions, --held-out and --steps >= 1"),
    (["approvals", "--out", __file__], "bench approvals --out " + __file__ + ": not an empty directory"),
    (["memory", "--model", "tiny-arith", "--budget", "12XB"], "cannot read '12XB'"),
    (["utilisation", "--group", "1"], "bench utilisation: need --prompts, --prompt-len, --completion-len >= 1 and "
                                      "--group >= 2"),
    (["utilisation", "--device", "cuda"], "bench utilisation: --device is for bench prompt-cache and memory"),
    (["grpo-step", "--repeats", "1", "--qunat", "x"], "bench grpo-step: unknown flag '--qunat' (see localrl bench "
                                                      "grpo-step -h)"),
])
def test_bad_bench_flags_are_user_errors(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("which", ["agent-step", "approvals", "distributed", "export", "rollout", "utilisation",
                                   "world", "memory"])
def test_a_model_that_is_not_there_is_one_line_before_the_banner(capsys, which):
    """(The banner came first, and the error after seconds of loading; bench memory's after its table's header.)"""
    assert main(["bench", which, "--model", "nowhere-model"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, (out, err)
    assert "nowhere-model" in err and "no such directory, and not a built-in model" in err, err


@pytest.mark.slow
def test_grpo_step_without_trl_is_one_line(tmp_path):
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("raise ImportError('TRL is not installed')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = bench("grpo-step", *TINY, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "localrl: error: bench grpo-step: needs TRL (pip install -e '.[bench]')"


# -- every bench, tiny ---------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_prompt_cache_tiny():
    proc = bench("prompt-cache", *TINY, "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = re.search(r"^\s*12\s+6\s+2 \|\s+(\S+)\s+(\S+)\s+(\S+)x\s+(\S+)x \|\s+(\S+)\s+(\S+)\s+(\S+)x \|\s+(\S+)x$",
                    proc.stdout, re.M)
    assert row, proc.stdout
    naive_s, cached_s, speedup, limit, naive_mb, cached_mb, memory_ratio, rss_ratio = numbers(*row.groups())
    assert speedup > 0 and limit > 1 and memory_ratio > 0 and rss_ratio >= 0
    [result] = json_line(proc.stdout)
    assert (result["P"], result["R"], result["G"]) == (12, 6, 2)
    assert result["naive_s"] > 0 and result["cached_s"] > 0 and result["speedup"] > 0
    assert result["naive_bytes"] > 0 and result["cached_bytes"] > 0 and result["memory_ratio"] > 0


@pytest.mark.slow
def test_bench_grpo_step_tiny():
    proc = bench("grpo-step", *TINY, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checked: every prompt was 12 tokens and every completion 6 tokens in both" in proc.stdout
    line = re.search(r"^whole GRPO step, P=12 R=6 G=2: localrl (\S+) s, TRL GRPOTrainer (\S+) s "
                     r"-> localrl (\S+)x faster$", proc.stdout, re.M)
    assert line, proc.stdout
    _, _, speedup = numbers(*line.groups())
    assert speedup > 0
    result = json_line(proc.stdout)
    assert result["localrl_s"] > 0 and result["trl_s"] > 0 and result["speedup"] > 0


@pytest.mark.slow
def test_bench_export_tiny(builtin_model):
    proc = bench("export", "--quant", "q8_0", "--json")  # one type: each costs seconds (comma lists: tested above)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^q8_0 +(\S+ +){8}\| +same .*\| pass$", proc.stdout, re.M), proc.stdout
    [row] = json_line(proc.stdout)
    assert row["quant"] == "q8_0" and row["passed"] and row["tokens_identical"] and row["bytes"] > 0
    phases = row["seconds"]
    assert list(phases) == ["load", "write", "validate f16", "quantise", "validate"]
    assert all(phases[p] > 0 for p in phases), phases  # a q8_0 export runs every phase
    assert row["export_s"] == pytest.approx(sum(phases.values()))
    assert set(row["peak_gib"]) == set(phases) and all(0.2 < g < 8 for g in row["peak_gib"].values())
    assert 0 < row["top1"] <= 1 and row["kl_mean"] >= 0 and 0 <= row["median_rel_logit_error"] <= row["rel_logit_error"]


@pytest.mark.slow
def test_bench_rollout_tiny(builtin_model):
    proc = bench("rollout", "--model", "tiny-arith", "--prompts", "1", "--group", "2", "--completion-len", "4",
                 "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json_line(proc.stdout)
    assert [r["backend"] for r in rows] == ["torch, 4-bit NF4 base", "torch, full-precision base",
                                            "llama.cpp, batched (f16 GGUF, q8_0 values)", "llama.cpp, rows stopping"]
    assert all(r["tokens"] == 8 and r["tokens_per_s"] > 0 for r in rows[:3])
    assert 2 <= rows[3]["tokens"] <= 8 and rows[3]["tokens_per_s"] > 0  # every row makes a token, its stop at most
    assert "ratios to torch 4-bit:" in proc.stdout


@pytest.mark.slow
def test_bench_world_tiny():
    proc = bench("world", "--held-out", "3", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^all +(\d+\.\d% +){6}\d+ +6$", proc.stdout, re.M), proc.stdout
    assert json_line(proc.stdout)["all"]["episodes"] == 6


@pytest.mark.slow
def test_bench_agent_step_tiny():
    proc = bench("agent-step", "--prompts", "1", "--group", "2", "--repeats", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^  model decoding +\S+ s   environment +\S+ s", proc.stdout, re.M), proc.stdout
    line = re.search(r"^update: shared-prompt forward (\S+) s, concatenated (\S+) s: (\S+)x \(largest relative "
                     r"gradient difference (\S+)\)$", proc.stdout, re.M)
    assert line, proc.stdout
    shared, concat, speedup, err = numbers(*line.groups())
    assert shared > 0 and concat > 0 and speedup > 0 and err < 1e-3
    result = json_line(proc.stdout)
    assert result["model_s"] > 0 and result["turns"] >= 1 and result["isolation"]


@pytest.mark.slow
def test_bench_distributed_tiny(builtin_model):
    proc = bench("distributed", "--prompts", "1", "--group", "2", "--completion-len", "4", "--repeats", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^([12]) +(\d+) x (\d+) +(\S+) s +(\S+) ms +(\S+)% +(\S+) tok$", proc.stdout, re.M)
    assert [(r[0], r[1], r[2]) for r in rows] == [("1", "1", "2"), ("2", "2", "2")], proc.stdout
    result = json_line(proc.stdout)
    one, two = result["rows"]
    assert one["allreduce_s"] == 0 and two["allreduce_s"] > 0  # a single process reduces nothing
    assert one["step_s"] > 0 and two["step_s"] > 0 and 0 < two["allreduce_share"] < 1
    assert result["efficiency"] == pytest.approx(one["step_s"] / two["step_s"])
    assert re.search(r"^weak-scaling efficiency, 2 processes: \S+ \(completions a second: \S+ -> \S+\); "
                     r"all-reduce \S+% of the 2-process step$", proc.stdout, re.M), proc.stdout


@pytest.mark.slow
def test_bench_memory_tiny(builtin_model):
    """Each phase in a fresh process: the planner's prediction beside the measured peak of the whole process,
    under the budget."""
    proc = bench("memory", "--model", "tiny-arith", "--budget", "700MB", "--prompts", "2", "--group", "2",
                 "--prompt-len", "12", "--completion-len", "6", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json_line(proc.stdout)
    assert [r["phase"] for r in rows] == ["load", "evaluation", "rollout", "update"]
    for r in rows:
        assert r["under_budget"] and r["measured_gib"] <= r["budget_gib"]
        assert 0.75 <= r["ratio"] <= 1.25, r


def test_bench_utilisation_counts_a_decoding_step_as_torchs_flop_counter_does(tiny_models):
    """The FLOP formula the utilisation benchmark divides by (benchmarks/utilisation.py) equals torch's own
    count of a decoding step: every layer's products, the adapters', attention over the cache, the head."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import DynamicCache

    from localrl.benchmarks.utilisation import token_flops
    from localrl.config import TrainConfig
    from localrl.memory import ModelShape
    from localrl.modeling import load_config, load_policy, pick_device

    cfg = TrainConfig(model=str(tiny_models["qwen2"]), lora_rank=4).validate()
    model, _ = load_policy(cfg, pick_device("cpu"), False)
    shape = ModelShape.from_config(load_config(cfg.model)[1])
    rows, cached = 3, 9
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.randint(3, 50, (rows, cached)), cache=cache, use_cache=True)
        # attention as matrix products torch counts (its CPU flash kernel is not in the counter's table)
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            model(input_ids=torch.randint(3, 50, (rows, 1)), position_ids=torch.full((rows, 1), cached),
                  cache=cache, use_cache=True)
    head = 2 * shape.hidden * shape.vocab
    assert counter.get_total_flops() == rows * (token_flops(shape, 4, cached + 1) + head)


@pytest.mark.slow
def test_bench_utilisation_tiny():
    proc = bench("utilisation", "--model-size", "tiny", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^machine: \d+ threads; 256x256 matrix product, best of 5: float32 [\d.]+ GFLOP/s; ",
                     proc.stdout, re.M), proc.stdout
    result = json_line(proc.stdout)
    assert result["float32_gflops"] > 0
    [model] = result["models"]
    phases = {p["phase"]: p for p in model["phases"]}
    assert list(phases) == ["rollout", "prompt forward", "completion forward", "backward", "optimizer", "step"]
    assert math.isclose(sum(p["seconds"] for n, p in phases.items() if n != "step"), phases["step"]["seconds"])
    for name, p in phases.items():
        assert p["seconds"] > 0 and 0 < p["share_of_step"] <= 1
        if name != "optimizer":
            assert p["gflop"] > 0 and 0 < p["share_of_peak"] < 2, p  # a share of a measured peak, not a guess
        assert re.search(rf"^{name}\s+[\d.]+\s+[\d.]+%", proc.stdout, re.M), name
