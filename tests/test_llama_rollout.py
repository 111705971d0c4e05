"""Grouped sampling in llama.cpp: the same completions as torch when greedy, the same again for a seed."""

from __future__ import annotations

import pytest
import torch

from localrl.data import load_task
from localrl.generation.llama_rollout import LlamaCppSampler
from localrl.generation.rollout import encode_prompts, sample_groups, stop_token_ids
from localrl.modeling import load_full, load_tokenizer
from localrl.quant.gguf_writer import write_gguf


@pytest.fixture(scope="module")
def setup(builtin_model, tmp_path_factory):
    model, tok = load_full(str(builtin_model)).eval(), load_tokenizer(str(builtin_model))
    gguf = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    write_gguf(model.state_dict(), model.config, builtin_model, tok, gguf, "f32")
    prompts = encode_prompts(tok, load_task("arith", eval_size=3).held_out)
    sampler = LlamaCppSampler(gguf, max_rows=3 * 4, max_tokens=max(map(len, prompts)) + 40)
    yield model, tok, prompts, sampler
    sampler.close()


def test_greedy_groups_equal_torchs(setup):
    model, tok, prompts, sampler = setup
    stops = stop_token_ids(tok, model)
    ours = sampler.sample_groups(prompts, 2, 40, stops, temperature=0.0).tokens
    rollout = sample_groups(model, prompts, 2, 40, stops, tok.pad_token_id, temperature=0.0)
    theirs = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
    assert ours == theirs and all(row[-1] in stops for row in ours)  # whole answers, each ending in its stop
    assert "<answer>" in tok.decode(ours[0])


def test_a_seed_gives_the_same_completions_and_another_seed_others(setup):
    _, tok, prompts, sampler = setup
    first = sampler.sample_groups(prompts, 4, 40, [], temperature=1.0, seed=3).tokens
    assert first == sampler.sample_groups(prompts, 4, 40, [], temperature=1.0, seed=3).tokens
    assert first != sampler.sample_groups(prompts, 4, 40, [], temperature=1.0, seed=4).tokens
    assert len(first) == 12 and all(len(row) == 40 for row in first)
    groups = [{tuple(row) for row in first[i:i + 4]} for i in range(0, 12, 4)]
    assert max(map(len, groups)) > 1  # the sequences of a group are sampled apart


@pytest.mark.slow
def test_a_trained_adapter_as_a_gguf_lora_samples_as_the_merged_torch_policy(builtin_model, tmp_path):
    """llama.cpp with the base GGUF and the adapter written as a GGUF LoRA (attached, not merged)
    decodes greedily what torch decodes with the adapter merged."""
    from peft import get_peft_model_state_dict

    from localrl.config import TrainConfig
    from localrl.quant.lora_gguf import write_lora_gguf
    from localrl.runs import Run
    from localrl.training.loop import train

    cfg = TrainConfig(steps=3, prompts_per_step=8, group_size=8, eval_size=0, lr=5e-3, seed=1,
                      run_dir=str(tmp_path / "run")).validate()
    train(cfg, log=lambda *_: None)
    run = Run(tmp_path / "run")
    merged, tok, _, _ = run.load_merged()
    policy, _, _ = run.load_adapter(torch.device("cpu"), False, cfg)
    base = load_full(str(builtin_model))
    base_gguf, lora_gguf = tmp_path / "base.gguf", tmp_path / "lora.gguf"
    write_gguf(base.state_dict(), base.config, builtin_model, tok, base_gguf, "f32")
    write_lora_gguf(get_peft_model_state_dict(policy), base.config, cfg.lora_alpha, lora_gguf)
    prompts = encode_prompts(tok, load_task("arith", eval_size=6).held_out)
    stops = stop_token_ids(tok, merged)
    rollout = sample_groups(merged.eval(), prompts, 1, 40, stops, tok.pad_token_id, temperature=0.0)
    want = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
    untrained = sample_groups(base.eval(), prompts, 1, 40, stops, tok.pad_token_id, temperature=0.0)
    assert want != [ids[m.bool()].tolist() for ids, m in zip(untrained.completion_ids, untrained.completion_mask)]
    sampler = LlamaCppSampler(base_gguf, max_rows=6, max_tokens=max(map(len, prompts)) + 40)
    try:
        sampler.set_adapter(lora_gguf, 1.0)
        assert sampler.sample_groups(prompts, 1, 40, stops, temperature=0.0).tokens == want
        sampler.set_adapter(None)  # detached again: the base's own completions
        assert sampler.sample_groups(prompts, 1, 40, stops, temperature=0.0).tokens != want
    finally:
        sampler.close()


def test_draws_follow_the_softmax_at_the_temperature_and_report_its_log_probabilities():
    import numpy as np

    from localrl.generation.llama_rollout import _draw

    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(3, 12)).astype(np.float32)
    want = torch.softmax(torch.tensor(logits) / 0.7, dim=-1).numpy()  # [3, 12]
    counts = np.zeros_like(want)
    for _ in range(4000):  # 4000 draws a row: frequencies within ~0.02 of the probabilities
        tokens, logps = _draw(logits, 0.7, rng)
        counts[np.arange(3), tokens] += 1
        assert np.allclose(logps, np.log(want[np.arange(3), tokens]), atol=1e-5)
    assert np.abs(counts / 4000 - want).max() < 0.03
    greedy, zeros = _draw(logits, 0.0, rng)
    assert (greedy == logits.argmax(-1)).all() and not zeros.any()
