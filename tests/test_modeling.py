"""Loading: 4-bit NF4 bases with LoRA for every supported family, and clear errors for bad models."""

import json

import pytest
import torch
from safetensors.torch import load_file

from localrl.config import TrainConfig
from localrl.errors import UserError
from localrl.generation.rollout import encode_prompts, sample_groups, stop_token_ids
from localrl.modeling import load_config, load_policy, pick_device
from localrl.modeling import count_4bit_layers
from localrl.policy.shared_prompt import ConcatForward
from localrl.training.loop import train
from tests.helpers import distinct_chars


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_config_loads_in_4bit_with_lora_and_one_step_changes_the_adapter(tiny_models, tmp_path, arch):
    cfg = TrainConfig(model=str(tiny_models[arch]), quantize="nf4", steps=1, prompts_per_step=2, group_size=4,
                      max_new_tokens=8, eval_size=0, run_dir=str(tmp_path / "run")).validate()
    model, _ = load_policy(cfg, pick_device("cpu"))
    assert count_4bit_layers(model) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    records = []
    result = train(cfg, rewards=([distinct_chars], [1.0]), listeners=[records.append], log=lambda *_: None)
    trained = load_file(str(result.run_dir / "checkpoints" / "step-000001" / "adapter_model.safetensors"))
    assert len(trained) == len(initial)
    changed = [k for k, v in trained.items() if "lora_B" in k and v.abs().sum() > 0]
    assert changed  # B starts at zero: the step moved it
    step = next(r for r in records if r["kind"] == "train")
    assert step["loss"] != 0 and step["kl"] is not None


def test_gradients_survive_a_sampling_pass(tiny_models):
    """bitsandbytes repacks 4-bit weights for CPU inference after an eval-mode pass; gradients must not change."""
    cfg = TrainConfig(model=str(tiny_models["llama"]), quantize="nf4").validate()

    def lora_grads(sample_first: bool):
        torch.manual_seed(0)
        model, tok = load_policy(cfg, pick_device("cpu"))
        prompts = encode_prompts(tok, [{"prompt": "What is 1 + 2?"}, {"prompt": "Hi"}])
        g = torch.Generator().manual_seed(0)
        rollout = sample_groups(model, prompts, 2, 6, stop_token_ids(tok, model), tok.pad_token_id, 1.0, g)
        if not sample_first:  # a fresh model that never ran in eval mode
            torch.manual_seed(0)
            model, tok = load_policy(cfg, pick_device("cpu"))
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():  # give B weights a value so all paths carry gradient
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=g)
        model.train()
        with ConcatForward(model, rollout) as fwd:
            fwd.logprobs(slice(0, 4)).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    after_sampling, fresh = lora_grads(True), lora_grads(False)
    for name in fresh:
        assert torch.allclose(after_sampling[name], fresh[name], rtol=1e-4, atol=1e-6), name


def test_model_errors_are_one_clear_line(tmp_path):
    with pytest.raises(UserError, match="no such directory, and not a built-in model"):
        load_config(str(tmp_path / "missing-model"))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UserError, match="unsupported architecture 'gpt2'; supported: llama, mistral, qwen2, qwen3"):
        load_config(str(tmp_path / "gpt2"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a Hugging Face model directory"):
        load_config(str(tmp_path / "empty"))
    with pytest.raises(UserError, match="could not be fetched from the Hugging Face Hub"):
        load_config("nobody-localrl/no-such-model")
