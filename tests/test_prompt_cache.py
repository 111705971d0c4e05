"""The shared-prompt forward equals the naive concatenated forward: log-probs, gradients, updates."""

import pytest
import torch

from localrl.config import TrainConfig
from localrl.generation.rollout import Rollout, left_pad
from localrl.modeling import load_base, load_policy, pick_device
from localrl.policy.shared_prompt import ConcatForward, SharedPromptForward, token_logprobs
from tests.helpers import randomise_lora, rel_err

G = 3


def make_rollout(vocab: int, pad_id: int, seed: int = 0) -> Rollout:
    """3 prompts of different lengths (left padding), G completions each of mixed lengths (right padding)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 2)]
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    lengths = torch.tensor([7, 3, 1, 7, 5, 2, 4, 7, 6])
    r = int(lengths.max())
    completion_mask = (torch.arange(r)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(0, vocab, (len(lengths), r), generator=g)
    completion_ids = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, pad_id))
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, lengths == r, G)


def lora_policy(model_dir, four_bit: bool = True, compute_dtype: str = "float32"):
    """A tiny model with LoRA whose B weights are non-zero, so gradients reach every adapter weight."""
    cfg = TrainConfig(model=str(model_dir), quantize="nf4" if four_bit else "none",
                      compute_dtype=compute_dtype).validate()
    torch.manual_seed(0)
    model, tok = load_policy(cfg, pick_device("cpu"))
    randomise_lora(model)
    model.train()
    return model, make_rollout(len(tok), tok.pad_token_id)


def logprobs_and_grads(model, rollout, forward_cls, micro_batch: int):
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1, 1, rollout.completion_ids.numel()).reshape(rollout.completion_ids.shape)
    n = rollout.completion_ids.size(0)
    outs = []
    with forward_cls(model, rollout, chunk_tokens=4) as fwd:
        for i in range(0, n, micro_batch):
            rows = slice(i, min(i + micro_batch, n))
            logp = fwd.logprobs(rows)
            (logp * weights[rows] * rollout.completion_mask[rows]).sum().backward()
            outs.append(logp.detach())
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return torch.cat(outs), grads


def assert_same(naive, cached, mask, tolerance: float = 1e-4):
    (lp_a, g_a), (lp_b, g_b) = naive, cached
    m = mask.bool()
    assert rel_err(lp_b[m], lp_a[m]) <= tolerance
    assert g_a.keys() == g_b.keys() and g_a
    for k in g_a:
        assert rel_err(g_b[k], g_a[k]) <= tolerance, k


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("four_bit", [True, False])
def test_lora_logprobs_and_gradients_match_the_naive_path(tiny_models, arch, four_bit):
    model, rollout = lora_policy(tiny_models[arch], four_bit)
    naive = logprobs_and_grads(model, rollout, ConcatForward, micro_batch=9)
    cached = logprobs_and_grads(model, rollout, SharedPromptForward, micro_batch=4)  # crosses prompt groups
    assert_same(naive, cached, rollout.completion_mask)
    assert any("lora_A" in k for k in naive[1]) and all("lora" in k for k in naive[1])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("four_bit", [True, False])
def test_under_bfloat16_compute_too(tiny_models, arch, four_bit):
    """The same under compute_dtype = bfloat16, within what bfloat16 allows: its 8-bit significand rounds every
    activation by up to 2^-9 (0.2%), and the two paths round at different places (the prompt's keys and values
    are computed once, in a batch of another shape), so log-probabilities differ by ~3.5e-4 and single adapter
    gradients by ~1.5e-2 of the largest (measured on the tiny models); bfloat16 against float32 on one path is
    3-7e-2 apart, and a wrong position or mask is off by order 1."""
    model, rollout = lora_policy(tiny_models[arch], four_bit, compute_dtype="bfloat16")
    naive = logprobs_and_grads(model, rollout, ConcatForward, micro_batch=9)
    cached = logprobs_and_grads(model, rollout, SharedPromptForward, micro_batch=4)
    assert_same(naive, cached, rollout.completion_mask, tolerance=5e-2)
    m = rollout.completion_mask.bool()
    assert rel_err(cached[0][m], naive[0][m]) <= 2e-3


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_full_precision_all_parameter_gradients_match(tiny_models, arch):
    model = load_base(str(tiny_models[arch]), load_in_4bit=False, device=pick_device("cpu"))
    model.requires_grad_(True)
    model.train()
    rollout = make_rollout(model.config.vocab_size, model.config.pad_token_id)
    naive = logprobs_and_grads(model, rollout, ConcatForward, micro_batch=9)
    cached = logprobs_and_grads(model, rollout, SharedPromptForward, micro_batch=2)
    assert_same(naive, cached, rollout.completion_mask)
    assert len(naive[1]) == len(list(model.parameters()))


def test_gradient_checkpointing_gives_the_same_gradients(tiny_models):
    model, rollout = lora_policy(tiny_models["qwen2"])
    plain = logprobs_and_grads(model, rollout, SharedPromptForward, micro_batch=4)
    from localrl.policy.shared_prompt import enable_checkpointing

    enable_checkpointing(model)
    checkpointed = logprobs_and_grads(model, rollout, SharedPromptForward, micro_batch=4)
    assert_same(plain, checkpointed, rollout.completion_mask)


def test_padding_past_a_completions_end_is_never_computed(tiny_models):
    """Completions of 1-7 tokens: the backbone sees each prompt's completions packed at their real lengths
    (the equivalence tests above hold the results equal to the naive path), the output head completion tokens
    only."""
    model, rollout = lora_policy(tiny_models["llama"], four_bit=False)
    fed, heads = [], []
    hooks = [model.get_base_model().model.register_forward_pre_hook(
                 lambda m, a, kw: fed.append(kw["input_ids"].numel()), with_kwargs=True),
             model.get_base_model().get_output_embeddings().register_forward_hook(
                 lambda m, a, out: heads.append(a[0].shape[:-1].numel()))]
    try:
        with torch.no_grad(), SharedPromptForward(model, rollout, chunk_tokens=1024) as fwd:
            fwd.logprobs(slice(0, 9))
    finally:
        for h in hooks:
            h.remove()
    lengths = rollout.completion_mask.sum(-1)
    # the prompt pass, then 3 prompts' completions side by side, each row feeding all but its last token
    per_prompt = (lengths - 1).view(3, G).sum(-1)
    assert fed == [rollout.prompt_ids.numel(), 3 * int(per_prompt.max())]
    assert heads == [int(lengths.sum())]  # against 9 x 7 = 63 padded


def test_chunked_logprobs_and_entropy_match_full_softmax():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(3, 5, 8, requires_grad=True)
    targets = torch.randint(0, 50, (3, 5))
    logp, ent = token_logprobs(head, hidden, targets, temperature=0.7, chunk_tokens=4, with_entropy=True)
    full = torch.log_softmax(head(hidden) / 0.7, dim=-1)
    assert torch.allclose(logp, full.gather(-1, targets[..., None]).squeeze(-1), atol=1e-6)
    assert torch.allclose(ent, -(full.exp() * full).sum(-1), atol=1e-5)
    logp.sum().backward()
    ref = hidden.grad.clone()
    hidden.grad = None
    full.gather(-1, targets[..., None]).sum().backward()
    assert torch.allclose(hidden.grad, ref, atol=1e-6)


def test_one_optimizer_step_updates_the_same_with_and_without_the_prompt_cache(builtin_model, tmp_path):
    from safetensors.torch import load_file

    from localrl.training.loop import train

    adapters = []
    for cached in (True, False):
        cfg = TrainConfig(steps=1, prompts_per_step=4, group_size=4, eval_size=0, micro_batch_size=5,
                          prompt_cache=cached, run_dir=str(tmp_path / f"run-{cached}")).validate()
        result = train(cfg, log=lambda *_: None)
        adapters.append(load_file(str(result.run_dir / "checkpoints" / "step-000001" / "adapter_model.safetensors")))
    cached, naive = adapters
    # LoRA B starts at zero, so after one step B is exactly the update (A barely moves from its init).
    updates = [k for k in naive if "lora_B" in k]
    assert len(updates) == 4 * 7 and all(naive[k].abs().sum() > 0 for k in updates)
    # Adam's first step is lr * g / (|g| + eps), which turns float32 noise in near-zero gradient
    # entries into full-size differences of single elements; compare whole tensors (Frobenius norm).
    for k in updates:
        assert ((cached[k] - naive[k]).norm() / naive[k].norm()).item() <= 1e-4, k


class _NoStep:
    """An optimizer that leaves the gradients where policy_update put them."""

    def zero_grad(self, set_to_none=True):
        pass

    def step(self):
        pass


@pytest.mark.parametrize("micro_batch", [0, 2])
@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0],
                                     [1.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.0, 1.0, 0.0]], ids=["binary", "graded"])
def test_groups_that_scored_alike_are_skipped_without_changing_the_gradient(tiny_models, micro_batch, rewards):
    """With beta 0, policy_update computes only the groups with a learning signal; the gradient equals the
    full batch's (every completion through the loss, divided by all of them) to float rounding. With
    graded rewards (partial credit) a group with a signal can hold a completion of zero advantage, the
    group's mean: the group is still computed."""
    from localrl.policy.grpo import policy_update
    from localrl.policy.losses import group_advantages, grpo_loss

    model, rollout = lora_policy(tiny_models["llama"], four_bit=False)
    advantages = group_advantages(torch.tensor(rewards), G).float()
    flat = [bool(advantages[b * G:(b + 1) * G].eq(0).all()) for b in range(3)]
    assert flat == [True, False, True] if rewards[6] == rewards[7] else flat == [True, False, False]
    assert advantages[4].eq(0) == (rewards[4] == 0.5)  # the graded group's 0.5 is its mean: advantage 0
    cfg = TrainConfig(beta=0.0, max_grad_norm=0.0, temperature=1.0).validate()

    model.zero_grad(set_to_none=True)
    n = rollout.completion_ids.size(0)
    with ConcatForward(model, rollout, chunk_tokens=4) as fwd:
        logp = fwd.logprobs(slice(0, n))
        loss, _ = grpo_loss(logp, logp.detach(), advantages, rollout.completion_mask)
        (loss / n).backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    policy_update(model, _NoStep(), rollout, advantages, cfg, micro_batch=micro_batch)
    got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and len(got) > 0
    for k in want:
        assert rel_err(got[k], want[k]) < 1e-4, k


def test_a_step_where_every_group_scored_alike_moves_neither_adapter_nor_optimizer(tiny_models):
    """beta 0 and no signal: an optimizer step would replay Adam's momentum; policy_update takes none."""
    from localrl.policy.grpo import policy_update
    from localrl.policy.losses import group_advantages

    model, rollout = lora_policy(tiny_models["llama"], four_bit=False)
    cfg = TrainConfig(beta=0.0, temperature=1.0).validate()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    signal = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 2.0, 0.0, 1.0]), G).float()
    policy_update(model, optimizer, rollout, signal, cfg)  # momentum to replay
    before = [p.detach().clone() for p in params]
    steps = [s["step"].clone() for s in optimizer.state.values()]
    flat = group_advantages(torch.tensor([1.0] * 3 + [0.0] * 3 + [2.0] * 3), G).float()
    stats = policy_update(model, optimizer, rollout, flat, cfg)
    assert stats == {"loss": 0.0, "kl": None, "clip_frac": 0.0}
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert [s["step"] for s in optimizer.state.values()] == steps


def tree_rollout(vocab: int, pad_id: int) -> tuple[Rollout, Rollout]:
    """A prefix tree (2 trunks of different lengths, 3 branch points each, 2 completions per branch) and the same
    rows as plain prompt completions, each row's prompt being its trunk cut at its branch point."""
    g = torch.Generator().manual_seed(1)
    trunks = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 6)]
    cuts = [[3, 6, 9], [2, 2, 6]]  # (two branches at the same point: siblings of separate nodes)
    prompt_ids, prompt_mask = left_pad(trunks, pad_id)
    branch = torch.tensor([c for row in cuts for c in row for _ in range(2)])
    lengths = torch.tensor([4, 1, 6, 3, 2, 6, 5, 6, 1, 3, 6, 2])
    r = int(lengths.max())
    completion_mask = (torch.arange(r)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(0, vocab, (len(lengths), r), generator=g)
    completion_ids = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, pad_id))
    tree = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, lengths == r, 6, branch=branch)
    flat_ids, flat_mask = left_pad([trunks[i // 6][:c] for i, c in enumerate(branch.tolist())], pad_id)
    flat = Rollout(flat_ids, flat_mask, completion_ids, completion_mask, lengths == r, 1)
    return tree, flat


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_prefix_trees_shared_forward_equals_each_row_concatenated(tiny_models, arch):
    """The trunk computed once, each row branching off it (any micro-batch, across trunks), gives the log-probs and
    gradients of every row's prompt-and-prefix concatenated with its completion."""
    model, _ = lora_policy(tiny_models[arch], four_bit=False)
    tok_vocab = model.get_base_model().config.vocab_size
    tree, flat = tree_rollout(tok_vocab, model.get_base_model().config.pad_token_id or 0)
    naive = logprobs_and_grads(model, flat, ConcatForward, micro_batch=12)
    assert_same(naive, logprobs_and_grads(model, tree, ConcatForward, micro_batch=5), tree.completion_mask)
    for micro_batch in (12, 5):
        assert_same(naive, logprobs_and_grads(model, tree, SharedPromptForward, micro_batch), tree.completion_mask)
    # a cut changes the result: the rows do attend only to their own prefix
    moved = Rollout(tree.prompt_ids, tree.prompt_mask, tree.completion_ids, tree.completion_mask, tree.truncated, 6,
                    branch=tree.branch.clamp(max=5))
    other = logprobs_and_grads(model, moved, SharedPromptForward, 5)
    assert rel_err(other[0][tree.completion_mask.bool()], naive[0][tree.completion_mask.bool()]) > 1e-3
