"""The shipped tiny model: size, format, 4-bit loading, partial accuracy, and deterministic pretraining."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from localrl.config import TrainConfig
from localrl.data import load_task
from localrl.data.rewards import default_rewards
from localrl.evaluation.evaluate import evaluate
from localrl.modeling import load_base, load_tokenizer, pick_device
from localrl.modeling import count_4bit_layers
from localrl.models.build import PRETRAINING, build


def test_shipped_model_is_small_llama_with_reasoning_chat_template(builtin_model):
    config = json.loads((builtin_model / "config.json").read_text())
    assert config["model_type"] == "llama"
    n_params = sum(t.numel() for t in load_file(str(builtin_model / "model.safetensors")).values())
    assert n_params <= 10_000_000
    assert sum(f.stat().st_size for f in builtin_model.iterdir()) <= 20 * 2**20
    tok = load_tokenizer(str(builtin_model))
    text = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 2?"},
                                    {"role": "assistant", "content": "<think>1+2=3\n</think><answer>3</answer>"}],
                                   tokenize=False)
    assert text == ("<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>1+2=3\n</think><answer>3</answer><|im_end|>\n")
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1


def test_shipped_model_in_4bit_is_partly_right(builtin_model):
    model = load_base(str(builtin_model), load_in_4bit=True, device=pick_device("cpu"))
    assert count_4bit_layers(model) == 4 * 7
    tok = load_tokenizer(str(builtin_model))
    cfg = TrainConfig()
    result = evaluate(model, tok, load_task("arith", eval_size=200).held_out, *default_rewards(cfg.reward, cfg.format_weight),
                      max_new_tokens=cfg.max_new_tokens)
    assert 0.2 <= result["accuracy"] <= 0.6


def test_pretraining_is_deterministic_for_a_seed(tmp_path):
    quick = replace(PRETRAINING["tiny-arith"], steps=3, batch_size=8, hidden_size=32, intermediate_size=64, layers=1)
    quiet = {"log": lambda *_: None}
    a = load_file(str(build(tmp_path / "a", quick, **quiet) / "model.safetensors"))
    b = load_file(str(build(tmp_path / "b", quick, **quiet) / "model.safetensors"))
    c = load_file(str(build(tmp_path / "c", replace(quick, seed=1), **quiet) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.slow
def test_shell_pretraining_is_deterministic_for_a_seed(tmp_path):
    from localrl.models.shell_pretraining import ShellPretraining

    quick = ShellPretraining(steps=2, batch_size=4, hidden_size=32, intermediate_size=64, layers=1, corpus_tasks=20,
                        max_positions=512)
    quiet = {"log": lambda *_: None}
    a, b = (build(tmp_path / name, quick, **quiet) for name in ("a", "b"))
    for name in ("model.safetensors", "tokenizer.json", "pretraining.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.slow
def test_shipped_agent_is_small_and_makes_well_formed_tool_calls():
    from localrl.agent.tool_calls import parse_tool_calls
    from localrl.envs.shell_tasks import held_out_tasks
    from localrl.generation.agent_rollout import TurnFormat
    from localrl.generation.rollout import sample_groups, stop_token_ids
    from localrl.models import builtin_path

    path = builtin_path("tiny-shell")
    assert sum(f.stat().st_size for f in path.iterdir()) <= 20 * 2**20
    model, tok = load_base(str(path), False, pick_device("cpu")), load_tokenizer(str(path))
    tasks = held_out_tasks(15)
    fmt = TurnFormat(tok, None)
    rollout = sample_groups(model, [fmt.prompt_ids(t.instruction) for t in tasks], 1, 48, stop_token_ids(tok, model),
                            tok.pad_token_id, temperature=0.0)
    texts = [tok.decode(ids[m.bool()], skip_special_tokens=True) for ids, m in zip(rollout.completion_ids,
                                                                                   rollout.completion_mask)]
    assert sum(len(parse_tool_calls(t)) == 1 for t in texts) >= 14, texts  # its first turn: one command
