"""Steering vectors (localrl/policy/steering.py, ``localrl steer``): what they are fitted to, where they are added,
and the measurement on a trained run of the built-in model."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from localrl.commands.steer import gap_share
from localrl.config import TrainConfig
from localrl.policy.steering import (SteeredModel, SteeringVectors, boundary_ids, decoder_layers, learned_tokens,
                                     select, token_effects)
from tests.helpers import one_line


@pytest.fixture(scope="module")
def adapted(tiny_models):
    """A tiny Llama with a LoRA adapter that is not zero (so it moves every layer's output)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    return model.eval(), AutoTokenizer.from_pretrained(tiny_models["llama"])


def layer_outputs(model, ids, **kw) -> list[torch.Tensor]:
    seen = []
    handles = [layer.register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
               for layer in decoder_layers(model)]
    try:
        with torch.no_grad():
            model(input_ids=ids, **kw)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_the_vectors_add_up_to_how_far_the_adapter_moves_each_layers_output(adapted):
    model, _ = adapted
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (5, 12), generator=g)
    mask = torch.ones_like(ids)
    tokens = torch.tensor([3, 5, 7, 11, 13])
    fitted = SteeringVectors.fit(model, ids, mask, 4, "learned", tokens, batch=2)  # batches of 2, 2 and 1 sequences
    chosen = select(ids, 4, tokens)
    with_adapter = layer_outputs(model, ids)
    with model.disable_adapter():
        without = layer_outputs(model, ids)
    moved = torch.stack([(w - b)[chosen].mean(0) for w, b in zip(with_adapter, without)])  # D_l
    assert fitted.positions == int(chosen.sum())
    assert (fitted.vectors[0] == 0).all()  # llama.cpp steers from layer 1: layer 1 takes D_1 whole
    assert torch.allclose(fitted.vectors[1:].cumsum(0), moved[1:], atol=1e-5)
    assert moved.norm() > 0.1  # the adapter does move them


def test_the_vector_is_added_at_the_selected_positions_only_while_decoding(adapted):
    model, tok = adapted
    last = len(decoder_layers(model)) - 1
    vector = torch.randn(model.config.hidden_size)
    vectors = torch.zeros(last + 1, model.config.hidden_size)
    vectors[last] = vector  # only the last layer: the layers before it see nothing of it
    ends = boundary_ids(tok)
    other = next(i for i in range(3, len(tok)) if i not in set(ends.tolist()))
    prompts = torch.randint(3, 100, (2, 6))
    step = torch.tensor([[int(ends[0])], [other]])  # row 0 feeds a token that ends a sentence, row 1 does not
    with model.disable_adapter():
        plain_cache, steered_cache = DynamicCache(), DynamicCache()
        plain = [layer_outputs(model, prompts, past_key_values=plain_cache, use_cache=True)[last]]
        plain.append(layer_outputs(model, step, past_key_values=plain_cache, use_cache=True)[last])
        steering = SteeredModel(model, SteeringVectors(vectors, "starts", ends, 1), scale=2.0)
        with steering.on():
            steered = [layer_outputs(model, prompts, past_key_values=steered_cache, use_cache=True)[last]]
            steered.append(layer_outputs(model, step, past_key_values=steered_cache, use_cache=True)[last])
        after = layer_outputs(model, prompts)[last]  # the hooks are gone
    prefill, decode = steered[0] - plain[0], steered[1] - plain[1]
    assert torch.allclose(prefill[:, -1], 2 * vector.expand(2, -1), atol=1e-5)  # the last prompt position
    assert prefill[:, :-1].abs().max() < 1e-6
    assert torch.allclose(decode[0, 0], 2 * vector, atol=1e-5) and decode[1].abs().max() < 1e-6
    assert steering.share == 3 / 4  # both prompts' last positions and one of the two decoded
    assert torch.equal(after, plain[0])


def test_a_selector_picks_the_last_prompt_position_and_then_its_tokens_or_everything():
    ids = torch.tensor([[5, 6, 7, 1, 8, 1, 9]])
    assert select(ids, 3, torch.tensor([1])).tolist() == [[False, False, True, True, False, True, False]]
    assert select(ids, 3, None).tolist() == [[False, False] + [True] * 5]


def test_the_learned_selector_takes_the_tokens_where_the_adapter_changes_the_prediction_most(adapted):
    model, _ = adapted
    ids = torch.randint(3, 40, (4, 16), generator=torch.Generator().manual_seed(2))
    kl, count = token_effects(model, ids, torch.ones_like(ids), 4, batch=3)
    assert count.sum() == 4 * 13 and (kl[count == 0] == 0).all() and (kl[count > 0] > 0).all()
    # one row by hand: the KL divergence at the last prompt position, fed token ids[0, 3]
    with torch.no_grad():
        trained = model(input_ids=ids[:1]).logits[0, 3].log_softmax(-1)
        with model.disable_adapter():
            base = model(input_ids=ids[:1]).logits[0, 3].log_softmax(-1)
    assert kl[ids[0, 3]] >= (trained.exp() * (trained - base)).sum() - 1e-6
    tokens = learned_tokens(kl, count, 0.25)
    mean = kl / count.clamp(min=1)
    assert count[tokens].sum() / count.sum() >= 0.25 > count[tokens[:-1]].sum() / count.sum()
    assert mean[tokens].min() >= mean[(count > 0) & ~torch.isin(torch.arange(len(kl)), tokens)].max()


def test_the_share_of_the_gap_and_its_paired_interval():
    base, trained = [0, 0, 1, 0] * 25, [1, 1, 1, 0] * 25
    steered = [1, 0, 1, 0] * 25  # half of the problems the training fixed
    r = gap_share(base, steered, trained)
    assert r["share"] == pytest.approx(0.5) and r["ci95"][0] < 0.5 < r["ci95"][1] and r["ci95"][1] - r["ci95"][0] < 0.5
    assert gap_share(base, steered, base) == {"share": None, "ci95": None}


def test_bad_steer_settings_are_one_line(capsys, tmp_path):
    assert "--fit-size must be at least 1" in one_line(capsys, "steer", str(tmp_path), "--fit-size", "0")
    assert "--scale must be a finite number" in one_line(capsys, "steer", str(tmp_path), "--scale", "nan")
    assert "written as safetensors" in one_line(capsys, "steer", str(tmp_path), "--out", "v.bin")
    assert "unknown choice 'sometimes'" in one_line(capsys, "steer", str(tmp_path), "--selector", "sometimes")
    assert "--share must be above 0 and at most 1" in one_line(capsys, "steer", str(tmp_path), "--share", "0")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, builtin_model):
    """12 GRPO steps of the built-in model on its addition task (held-out 34% before)."""
    from localrl.training.loop import train
    from tests.helpers import QUIET

    run = tmp_path_factory.mktemp("steer") / "run"
    train(TrainConfig(steps=12, eval_size=0, save_every=12, run_dir=str(run), seed=0).validate(), **QUIET)
    return run


@pytest.mark.slow
def test_localrl_steer_measures_base_steered_and_trained_on_the_same_problems(trained_run, tmp_path, capsys):
    """12 steps move the residual stream less than the README's 40 (the last layer's vector has norm 34 against
    123): at scale 1 no greedy answer of the built-in model changes (measured: 41.7% steered and unsteered), at
    scale 3 every position's vectors recover 69% of the gap (81.7%) and at 10 they overshoot (0%)."""
    from safetensors.torch import load_file

    from localrl.cli import main

    out = tmp_path / "v.safetensors"
    args = ["steer", str(trained_run), "--selector", "learned", "--selector", "all", "--fit-size", "16",
            "--eval-size", "60", "--scale", "3", "--out", str(out), "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["n"] == 60 and r["trained"] > r["base"] + 0.2  # a gap to recover
    learned, every = r["steered"]["learned"], r["steered"]["all"]
    assert 0.05 < learned["positions"] < 0.4 and every["positions"] == 1.0
    # the vectors move the frozen base towards the trained model
    assert every["accuracy"] > r["base"] + 0.2 and every["share"] > 0.5 and every["ci95"][0] > 0
    saved = load_file(str(out))
    assert saved["vectors"].shape[0] == 4 and (saved["vectors"][0] == 0).all() and len(saved["tokens"]) > 0
