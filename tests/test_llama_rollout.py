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
def tiny(builtin_model, tmp_path_factory):
    """(the built-in model in float32, its tokenizer, the model written as an f32 GGUF)"""
    model, tok = load_full(str(builtin_model)).eval(), load_tokenizer(str(builtin_model))
    gguf = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    write_gguf(model.state_dict(), model.config, builtin_model, tok, gguf, "f32")
    return model, tok, gguf


@pytest.fixture(scope="module")
def setup(tiny):
    model, tok, gguf = tiny
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


def test_rows_that_stop_leave_the_rest_decoded_in_consecutive_sequences_with_torchs_tokens(tiny, monkeypatch):
    """llama.cpp computes each run of consecutive sequence ids in a batch apart: the live rows' caches move down
    into the streams that stopped rows leave, and every completion stays torch's greedy one."""
    model, tok, gguf = tiny
    prompts = encode_prompts(tok, load_task("arith", eval_size=12).held_out)
    stops = stop_token_ids(tok, model)
    sampler = LlamaCppSampler(gguf, max_rows=12, max_tokens=max(map(len, prompts)) + 40)
    seen, decode = [], sampler._decode
    monkeypatch.setattr(sampler, "_decode", lambda batch, entries: (seen.append([e[2] for e in entries]),
                                                                     decode(batch, entries)))
    try:
        ours = sampler.sample_groups(prompts, 1, 40, stops, temperature=0.0).tokens
    finally:
        sampler.close()
    rollout = sample_groups(model, prompts, 1, 40, stops, tok.pad_token_id, temperature=0.0)
    assert ours == [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
    steps = [seqs for seqs in seen if len(set(seqs)) == len(seqs)]  # one token a row: the decodes after the prompts
    assert steps and all(seqs == list(range(len(seqs))) for seqs in steps)
    live = [{r for r, row in enumerate(ours) if len(row) > t + 1} for t in range(40)]
    assert any(rows and rows != set(range(len(rows))) for rows in live)  # some row's cache had to move


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


def test_draws_a_few_rows_at_a_time_are_the_draws_of_all_rows_at_once():
    import numpy as np

    from localrl.generation.llama_rollout import _draw, _draw_rows
    from localrl.memory import LLAMA_DRAW_ROWS

    logits = np.random.default_rng(1).normal(scale=3.0, size=(3 * LLAMA_DRAW_ROWS + 5, 50)).astype(np.float32)
    order = np.arange(1, len(logits), 2)  # the rows still generating
    for temperature in (0.7, 0.0):
        tokens, logps = _draw_rows(logits, order, temperature, np.random.default_rng(2))
        want_tokens, want_logps = _draw(logits[order], temperature, np.random.default_rng(2))
        assert (tokens == want_tokens).all() and np.array_equal(logps, want_logps)


def test_the_sampler_is_written_from_the_policys_own_base_as_from_the_model_loaded_again(builtin_model, tiny,
                                                                                          tmp_path):
    from localrl.config import TrainConfig
    from localrl.modeling import base_weights, load_policy

    policy, tok = load_policy(TrainConfig(model=str(builtin_model)).validate(), torch.device("cpu"))
    full, _, _ = tiny
    weights = base_weights(policy)
    assert weights.keys() == full.state_dict().keys()
    write_gguf(weights, policy.config, builtin_model, tok, tmp_path / "own.gguf", "f16")
    write_gguf(full.state_dict(), full.config, builtin_model, tok, tmp_path / "loaded.gguf", "f16")
    assert (tmp_path / "own.gguf").read_bytes() == (tmp_path / "loaded.gguf").read_bytes()


def test_a_context_holds_the_cells_the_planner_counts_each_sequence_padded_as_llama_cpp_pads_it(tiny, tiny_models,
                                                                                                 tmp_path):
    """256 sequences of 40 tokens take 256 cells each in llama.cpp (one stream a sequence): 6.4x the cells
    asked for, resident as soon as the context exists; keys in f16, values in q8_0 where a head is 32 wide
    (the built-in model) and in f16 where it is 16 (a tiny Llama)."""
    from localrl.heap import collect
    from localrl.memory import ModelShape, llama_cells, llama_kv_bytes, resident_bytes

    assert llama_cells(256, 40) == 256 * 256 and llama_cells(8, 160) == 2048
    narrow = load_full(str(tiny_models["llama"]))
    write_gguf(narrow.state_dict(), narrow.config, tiny_models["llama"], load_tokenizer(str(tiny_models["llama"])),
               tmp_path / "narrow.gguf", "f32")
    for config, gguf, values in ((tiny[0].config, tiny[2], "q8_0"), (narrow.config, tmp_path / "narrow.gguf", "f16")):
        shape = ModelShape.from_config(config)
        kv = llama_kv_bytes(shape, 256, 40)
        f16 = shape.kv_bytes(llama_cells(256, 40))
        assert (kv < 0.8 * f16) if values == "q8_0" else (kv == f16)
        collect()  # the heap's free pages (this worker's earlier tests, the context before) handed back first
        before = resident_bytes("RssAnon")
        sampler = LlamaCppSampler(gguf, 256, 40)
        grown = resident_bytes("RssAnon") - before
        sampler.close()
        assert 0.9 * kv < grown < 1.1 * kv + 16 * 2**20, (values, grown, kv)
