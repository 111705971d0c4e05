"""localrl's GRPO update against TRL's own loss code: for each loss type, TRL's ``GRPOTrainer.compute_loss``
and localrl's ``grpo_step`` see the same model, adapter and rollout, and must give the same loss and
the same gradient on every LoRA weight; and localrl's gradient must not depend on the micro-batch size."""

import pytest
import torch

from localrl.config import LOSS_TYPES, TrainConfig
from localrl.losses import group_advantages
from localrl.modeling import load_policy, pick_device
from localrl.rollout import Rollout
from localrl.grpo import grpo_step

G, R, TEMPERATURE = 4, 9, 0.7


def _policy(model_dir):
    cfg = TrainConfig(model=str(model_dir), quantize="none").validate()
    torch.manual_seed(0)
    model, tok = load_policy(cfg, pick_device("cpu"))
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # non-zero B weights: every adapter weight gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2, generator=g)
    model.train()
    return model, tok


def _rollout(vocab: int, pad_id: int) -> tuple[Rollout, torch.Tensor]:
    """3 prompts of one length (TRL gives the model no position ids, so no left padding), G completions
    each of mixed lengths (right padding, one cut at R), and rewards that differ within every group."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, 256, (3, 6), generator=g)
    lengths = torch.tensor([R, 3, 1, 7, 5, 2, 4, R, 6, 8, 2, 5])
    mask = (torch.arange(R)[None] < lengths[:, None]).long()
    ids = torch.where(mask.bool(), torch.randint(0, vocab, (len(lengths), R), generator=g), pad_id)
    rollout = Rollout(prompt_ids, torch.ones_like(prompt_ids), ids, mask, lengths == R, G)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.2, 0.3, 0.0, 0.0, 1.0])
    return rollout, rewards


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _localrl(model, rollout, advantages, loss_type: str, micro_batch: int) -> tuple[float, dict]:
    cfg = TrainConfig(loss_type=loss_type, beta=0.0, max_grad_norm=0.0, temperature=TEMPERATURE,
                      max_new_tokens=R, group_size=G).validate()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)  # keeps the weights
    stats = grpo_step(model, optimizer, rollout, advantages, cfg, micro_batch=micro_batch)
    return stats["loss"], _lora_grads(model)


def _trl(model, tok, rollout, advantages, loss_type: str, tmp_path) -> tuple[float, dict]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    n = rollout.completion_ids.size(0)
    args = GRPOConfig(output_dir=str(tmp_path / loss_type), use_cpu=True, loss_type=loss_type, beta=0.0,
                      num_generations=G, per_device_train_batch_size=n, gradient_accumulation_steps=1,
                      max_completion_length=R, temperature=TEMPERATURE, report_to="none", save_strategy="no",
                      bf16=False, fp16=False, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * n), processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which is not run here
    inputs = {"prompt_ids": rollout.prompt_ids.repeat_interleave(G, 0),
              "prompt_mask": rollout.prompt_mask.repeat_interleave(G, 0),
              "completion_ids": rollout.completion_ids, "completion_mask": rollout.completion_mask,
              "advantages": advantages, "num_items_in_batch": rollout.completion_mask.sum()}
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return loss.item(), _lora_grads(model)


def _max_rel_err(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys() and ours
    return max(((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp(min=1e-12)).item() for k in ours)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_equal_trls(builtin_model, tmp_path, loss_type):
    model, tok = _policy(builtin_model)
    rollout, rewards = _rollout(len(tok), tok.pad_token_id)
    advantages = group_advantages(rewards, G)
    theirs_loss, theirs = _trl(model, tok, rollout, advantages, loss_type, tmp_path)
    ours_loss, ours = _localrl(model, rollout, advantages, loss_type, micro_batch=0)
    assert ours_loss == pytest.approx(theirs_loss, rel=1e-5, abs=1e-7)
    assert _max_rel_err(ours, theirs) < 1e-4


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradient_does_not_depend_on_the_micro_batch(builtin_model, loss_type):
    model, tok = _policy(builtin_model)
    rollout, rewards = _rollout(len(tok), tok.pad_token_id)
    advantages = group_advantages(rewards, G)
    whole_loss, whole = _localrl(model, rollout, advantages, loss_type, micro_batch=0)
    for micro_batch in (1, 5):
        loss, grads = _localrl(model, rollout, advantages, loss_type, micro_batch)
        assert loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
        assert _max_rel_err(grads, whole) < 1e-4


def test_loss_types_differ_where_lengths_differ(builtin_model):
    """The four normalisations give four different gradients on completions of mixed lengths (else the
    parity tests above could not tell a wrong normaliser from a right one)."""
    model, tok = _policy(builtin_model)
    rollout, rewards = _rollout(len(tok), tok.pad_token_id)
    advantages = group_advantages(rewards, G)
    grads = {t: _localrl(model, rollout, advantages, t, micro_batch=0)[1] for t in LOSS_TYPES}
    for a in LOSS_TYPES:
        for b in LOSS_TYPES:
            if a < b and {a, b} != {"bnpo", "dapo"}:  # these two share a normaliser in one process
                assert _max_rel_err(grads[a], grads[b]) > 1e-2, (a, b)
