"""localrl's GRPO update against TRL's own loss code: for each loss type, TRL's ``GRPOTrainer.compute_loss``
and localrl's ``policy_update`` see the same model, adapter and rollout, and must give the same loss and
the same gradient on every LoRA weight; and localrl's gradient must not depend on the micro-batch size."""

import pytest
import torch

from localrl.config import TrainConfig
from localrl.generation.rollout import Rollout, left_pad
from localrl.modeling import load_policy, pick_device
from localrl.policy.grpo import policy_update
from localrl.policy.losses import LOSSES, group_advantages

G, R, TEMPERATURE = 4, 9, 0.7
LOSS_TYPES = tuple(LOSSES)  # every registered policy loss: each one TRL has


def _policy(model_dir, b_std: float = 0.2, compute_dtype: str = "float32"):
    cfg = TrainConfig(model=str(model_dir), quantize="none", compute_dtype=compute_dtype).validate()
    torch.manual_seed(0)
    model, tok = load_policy(cfg, pick_device("cpu"))
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # non-zero B weights: every adapter weight gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=b_std, generator=g)
    model.train()
    return model, tok


def _rollout(vocab: int, pad_id: int, prompt_lengths=(6, 6, 6)) -> tuple[Rollout, torch.Tensor]:
    """3 prompts (of one length by default; shorter ones are left-padded), G completions each of mixed
    lengths (right padding, one cut at R), and rewards that differ within every group."""
    g = torch.Generator().manual_seed(0)
    prompt_ids, prompt_mask = left_pad([torch.randint(0, 256, (n,), generator=g).tolist() for n in prompt_lengths],
                                       pad_id)
    lengths = torch.tensor([R, 3, 1, 7, 5, 2, 4, R, 6, 8, 2, 5])
    mask = (torch.arange(R)[None] < lengths[:, None]).long()
    ids = torch.where(mask.bool(), torch.randint(0, vocab, (len(lengths), R), generator=g), pad_id)
    rollout = Rollout(prompt_ids, prompt_mask, ids, mask, lengths == R, G)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.2, 0.3, 0.0, 0.0, 1.0])
    return rollout, rewards


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _localrl(model, rollout, advantages, loss_type: str, micro_batch: int, **settings) -> tuple[float, dict]:
    cfg = TrainConfig(**{"loss_type": loss_type, "beta": 0.0, "max_grad_norm": 0.0, "temperature": TEMPERATURE,
                         "max_new_tokens": R, "group_size": G, **settings}).validate()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)  # keeps the weights
    stats = policy_update(model, optimizer, rollout, advantages, cfg, micro_batch=micro_batch)
    return stats["loss"], _lora_grads(model)


def _trl(model, tok, rollout, advantages, loss_type: str, tmp_path, beta: float = 0.0,
         use_bias_correction_kl: bool = True) -> tuple[float, dict]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    n = rollout.completion_ids.size(0)
    args = GRPOConfig(output_dir=str(tmp_path / loss_type), use_cpu=True, loss_type=loss_type, beta=beta,
                      use_bias_correction_kl=use_bias_correction_kl,
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
    if beta:  # the reference as TRL's sampling step computes it for a new adapter: the base, adapter off
        ids = torch.cat([inputs["prompt_ids"], rollout.completion_ids], 1)
        mask = torch.cat([inputs["prompt_mask"], rollout.completion_mask], 1)
        with torch.no_grad(), model.disable_adapter():
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(model, ids, mask, R, n)[0]
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return loss.item(), _lora_grads(model)


def _max_rel_err(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys() and ours
    return max(((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp(min=1e-12)).item() for k in ours)


def _equal_trls(model_dir, tmp_path, loss_type: str, compute_dtype: str, loss_rel: float, loss_abs: float,
                grad_tol: float) -> None:
    model, tok = _policy(model_dir, compute_dtype=compute_dtype)
    assert next(model.get_base_model().lm_head.parameters()).dtype == getattr(torch, compute_dtype)
    rollout, rewards = _rollout(len(tok), tok.pad_token_id)
    advantages = group_advantages(rewards, G)
    theirs_loss, theirs = _trl(model, tok, rollout, advantages, loss_type, tmp_path)
    ours_loss, ours = _localrl(model, rollout, advantages, loss_type, micro_batch=0)
    assert ours_loss == pytest.approx(theirs_loss, rel=loss_rel, abs=loss_abs)
    assert _max_rel_err(ours, theirs) < grad_tol


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_equal_trls(builtin_model, tmp_path, loss_type):
    _equal_trls(builtin_model, tmp_path, loss_type, "float32", loss_rel=1e-5, loss_abs=1e-7, grad_tol=1e-4)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "cispo"])
def test_under_bfloat16_compute_too(builtin_model, tmp_path, loss_type):
    """The same model computing in bfloat16 (compute_dtype; the adapter float32), within what bfloat16 allows:
    TRL takes the log-softmax of bfloat16 logits in bfloat16 (trl/trainer/utils.py selective_log_softmax) where
    localrl upcasts them to float32 first, and computes the prompt in the same batch as its completions. Measured
    on the built-in model: the losses 1e-6 apart where they do not depend on the log-probabilities' values
    (on-policy ratios are 1) and 3e-3 where they do (cispo), gradients 2.5-3.5e-2 of the largest; localrl's
    gradient in bfloat16 is 9-13e-2 from its own in float32."""
    _equal_trls(builtin_model, tmp_path, loss_type, "bfloat16", loss_rel=1e-2, loss_abs=1e-5, grad_tol=6e-2)


@pytest.mark.parametrize("loss_type, corrected", [("grpo", False), ("dapo", True)])
def test_loss_and_gradient_equal_trls_with_left_padding_and_a_kl_term(builtin_model, tmp_path, loss_type,
                                                                     corrected):
    """Prompts of unequal lengths (left padding: TRL passes no position ids, and rotary attention depends on
    relative positions only, so the shifted real tokens see the same attention) and beta > 0, the reference
    being the base (adapter off) in both. The adapter keeps the policy near its base, as in training: with
    the other tests' adapter the KL is ~1e4 a token, and the ratio-corrected KL's gradient, a difference of
    two terms that size, keeps only float32's last digits (1e-3 apart between any two implementations)."""
    model, tok = _policy(builtin_model, b_std=0.02)
    rollout, rewards = _rollout(len(tok), tok.pad_token_id, prompt_lengths=(6, 2, 4))
    assert not rollout.prompt_mask.bool().all()
    advantages = group_advantages(rewards, G)
    theirs_loss, theirs = _trl(model, tok, rollout, advantages, loss_type, tmp_path, 0.04, corrected)
    ours_loss, ours = _localrl(model, rollout, advantages, loss_type, micro_batch=0, beta=0.04,
                               use_bias_correction_kl=corrected)
    assert ours_loss == pytest.approx(theirs_loss, rel=1e-5, abs=1e-7)
    assert _max_rel_err(ours, theirs) < 1e-4
    # the KL term and the padding each change the gradient here (else this case could not tell them apart)
    without_kl = _localrl(model, rollout, advantages, loss_type, micro_batch=0)[1]
    equal_prompts, _ = _rollout(len(tok), tok.pad_token_id)
    unpadded = _localrl(model, equal_prompts, advantages, loss_type, micro_batch=0, beta=0.04,
                        use_bias_correction_kl=corrected)[1]
    assert _max_rel_err(without_kl, ours) > 1e-3 and _max_rel_err(unpadded, ours) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("prompt_cache", [True, False], ids=["prompt-cache", "concatenated"])
def test_gradient_does_not_depend_on_the_micro_batch(builtin_model, loss_type, prompt_cache):
    model, tok = _policy(builtin_model)
    rollout, rewards = _rollout(len(tok), tok.pad_token_id)
    advantages = group_advantages(rewards, G)
    settings = {"prompt_cache": prompt_cache, "beta": 0.04, **({"importance_sampling_level": "sequence"} if prompt_cache
                else {"top_entropy_quantile": 0.5, "entropy_coef": 0.01})}
    whole_loss, whole = _localrl(model, rollout, advantages, loss_type, 0, **settings)
    for micro_batch in (1, 3):
        loss, grads = _localrl(model, rollout, advantages, loss_type, micro_batch, **settings)
        assert loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
        # float32 sums in another order: 1.1e-4 of the largest entry seen on an AVX-512 machine; a wrong split
        # (a normaliser taken per micro-batch) is off by more than 1e-2 (test_loss_types_differ_where_lengths_differ)
        assert _max_rel_err(grads, whole) < 5e-4


def test_loss_types_differ_where_lengths_differ(builtin_model):
    """The normalisations give different gradients on completions of mixed lengths (else the parity tests
    above could not tell a wrong normaliser from a right one)."""
    model, tok = _policy(builtin_model)
    rollout, rewards = _rollout(len(tok), tok.pad_token_id)
    advantages = group_advantages(rewards, G)
    grads = {t: _localrl(model, rollout, advantages, t, micro_batch=0)[1] for t in LOSS_TYPES}
    # on-policy (every ratio 1) these coincide: bnpo and dapo share a normaliser in one process, sapo's gate
    # has grpo's slope at 1 and vespo's weight is 1 there
    alike = [{"bnpo", "dapo", "vespo"}, {"grpo", "sapo"}]
    for a in LOSS_TYPES:
        for b in LOSS_TYPES:
            if a < b and not any({a, b} <= group for group in alike):
                assert _max_rel_err(grads[a], grads[b]) > 1e-2, (a, b)


# -- every loss type and option, against TRL's loss code on the same per-token log-probabilities --------------

N_ROWS, WIDTH = 6, 7


@pytest.fixture(scope="module")
def trl_trainer(builtin_model, tmp_path_factory):
    """One GRPOTrainer whose loss settings each case sets; its model is never run (the log-probabilities
    are given), so the loss and its gradient with respect to them are TRL's formulas alone."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tok = _policy(builtin_model)
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, num_generations=2,
                      per_device_train_batch_size=N_ROWS, gradient_accumulation_steps=1,
                      max_completion_length=WIDTH, report_to="none", save_strategy="no", bf16=False, fp16=False,
                      disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * N_ROWS), processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _inputs():
    """Random log-probabilities in float64, old ones far enough off-policy that clipping is active, a
    reference policy, mixed-sign advantages, rows of different lengths (right padding)."""
    g = torch.Generator().manual_seed(5)
    logp = -torch.rand(N_ROWS, WIDTH, generator=g, dtype=torch.float64) * 3 - 0.05
    old = logp + 0.35 * torch.randn(N_ROWS, WIDTH, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(N_ROWS, WIDTH, generator=g, dtype=torch.float64)
    lengths = torch.tensor([WIDTH, 3, 1, 5, WIDTH, 2])
    mask = (torch.arange(WIDTH)[None] < lengths[:, None]).long()
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1, 0.9, -0.2], dtype=torch.float64)
    weights = torch.exp(0.2 * torch.randn(N_ROWS, WIDTH, generator=g, dtype=torch.float64))  # a sampler's
    entropies = torch.rand(N_ROWS, WIDTH, generator=g, dtype=torch.float64) * 2
    return logp, old, ref, mask, adv, weights, entropies


def _trl_loss(trainer, s, logp, old, ref, mask, adv, weights, entropies, quantile=1.0, entropy_coef=0.0):
    trainer.loss_type = s.loss_type
    trainer.top_entropy_quantile = quantile
    trainer.entropy_coef, trainer._entropy_bonus_enabled, trainer.use_adaptive_entropy = entropy_coef, bool(
        entropy_coef), False
    trainer.off_policy_mask_threshold = s.off_policy_mask_threshold or None
    trainer.importance_sampling_level = s.importance_sampling_level
    trainer.epsilon_low, trainer.epsilon_high = s.epsilon, s.epsilon_high or s.epsilon
    trainer.beta = s.beta
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = weights is not None
    for name in ("delta", "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                 "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        setattr(trainer.args, name, getattr(s, name))
    trainer.args.delta = s.delta or None
    leaf, ent = logp.clone().requires_grad_(True), entropies.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, ent, None)
    inputs = {"prompt_ids": torch.zeros(N_ROWS, 1, dtype=torch.long), "prompt_mask": torch.ones(N_ROWS, 1),
              "completion_ids": torch.zeros(N_ROWS, WIDTH, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum(), "importance_sampling_ratio": weights}
    loss = trainer._compute_loss(trainer.model, inputs)
    return loss.detach(), torch.cat(torch.autograd.grad(loss, [leaf, ent], allow_unused=True, materialize_grads=True))


def _localrl_loss(s, logp, old, ref, mask, adv, weights, entropies, quantile=1.0, entropy_coef=0.0):
    from localrl.policy.losses import grpo_loss, high_entropy_mask, high_entropy_threshold, loss_normalizer

    leaf, ent = logp.clone().requires_grad_(True), entropies.clone().requires_grad_(True)
    selected = high_entropy_mask(ent.detach(), mask, high_entropy_threshold(ent.detach(), mask, quantile)) \
        if quantile < 1 else None
    loss, _ = grpo_loss(leaf, old, adv, mask, s, ref if s.beta else None, weights, selected)
    loss = loss / loss_normalizer(s.loss_type, mask, WIDTH)
    if entropy_coef:
        acted = mask if selected is None else mask * selected
        loss = loss - entropy_coef * (ent * acted).sum() / acted.sum()
    return loss.detach(), torch.cat(torch.autograd.grad(loss, [leaf, ent], allow_unused=True, materialize_grads=True))


def _cases():
    from localrl.policy.losses import LossSettings

    cases = []
    for loss_type in LOSS_TYPES:
        for level in ("token", "sequence"):
            for beta, corrected in ((0.0, True), (0.04, True), (0.04, False)):
                cases.append(LossSettings(loss_type, importance_sampling_level=level, beta=beta,
                                          use_bias_correction_kl=corrected))
        clip = {"cispo": {"epsilon_high": 1.3}, "sapo": {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5},
                "vespo": {"vespo_k_pos": 1.5, "vespo_lambda_neg": 1.0}}.get(loss_type,
                                                                          {"epsilon_high": 0.28, "delta": 1.25})
        cases.append(LossSettings(loss_type, beta=0.04, **clip))
    return cases


@pytest.mark.parametrize("settings", _cases(), ids=lambda s: f"{s.loss_type}-{s.importance_sampling_level}-"
                         f"beta{s.beta}{'-corrected' if s.use_bias_correction_kl else ''}"
                         f"{'-eh' if s.epsilon_high else ''}{'-delta' if s.delta else ''}"
                         f"{'-temps' if s.sapo_temperature_pos != 1.0 else ''}{'-k' if s.vespo_k_pos != 2.0 else ''}")
@pytest.mark.parametrize("sampler_weights", [False, True], ids=["", "is-weights"])
def test_every_loss_and_option_equals_trls_formula(trl_trainer, settings, sampler_weights):
    logp, old, ref, mask, adv, weights, entropies = _inputs()
    weights = weights if sampler_weights else None
    theirs, theirs_grad = _trl_loss(trl_trainer, settings, logp, old, ref, mask, adv, weights, entropies)
    ours, ours_grad = _localrl_loss(settings, logp, old, ref, mask, adv, weights, entropies)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-12)
    assert (ours_grad - theirs_grad).abs().max() <= 1e-6 * theirs_grad.abs().max()
    assert theirs_grad.abs().max() > 0


def test_the_options_change_the_loss_where_they_should():
    """Each option changes the gradient on these inputs (else the parity cases could not tell it was ignored)."""
    from localrl.policy.losses import LossSettings

    logp, old, ref, mask, adv, _, entropies = _inputs()
    grad = lambda **kw: _localrl_loss(LossSettings(**kw), logp, old, ref, mask, adv, None, entropies)[1]  # noqa: E731
    base = grad(beta=0.04)
    for change in ({"epsilon_high": 0.28}, {"delta": 1.25}, {"importance_sampling_level": "sequence"},
                   {"off_policy_mask_threshold": 0.005},
                   {"use_bias_correction_kl": False}, *({"loss_type": t} for t in LOSS_TYPES if t != "grpo")):
        assert (grad(**{"beta": 0.04, **change}) - base).abs().max() > 1e-4 * base.abs().max(), change


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("quantile, entropy_coef, off_policy", [(0.4, 0.0, 0.0), (1.0, 0.01, 0.0), (0.4, 0.01, 0.005),
                                                                (1.0, 0.0, 0.005)],
                         ids=["top-entropy", "entropy-bonus", "all-three", "off-policy-mask"])
def test_entropy_controls_and_the_off_policy_mask_equal_trls(trl_trainer, loss_type, quantile, entropy_coef,
                                                              off_policy):
    from localrl.policy.losses import LossSettings

    logp, old, ref, mask, adv, _, entropies = _inputs()
    s = LossSettings(loss_type, beta=0.04, off_policy_mask_threshold=off_policy,
                     **({"epsilon_high": 1.3} if loss_type == "cispo" else {}))
    theirs, theirs_grad = _trl_loss(trl_trainer, s, logp, old, ref, mask, adv, None, entropies, quantile, entropy_coef)
    ours, ours_grad = _localrl_loss(s, logp, old, ref, mask, adv, None, entropies, quantile, entropy_coef)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-12)
    assert (ours_grad - theirs_grad).abs().max() <= 1e-6 * theirs_grad.abs().max()
    plain = _localrl_loss(LossSettings(loss_type, beta=0.04, **({"epsilon_high": 1.3} if loss_type == "cispo" else {})),
                          logp, old, ref, mask, adv, None, entropies)[1]
    assert (ours_grad - plain).abs().max() > 1e-6  # the option did something here
