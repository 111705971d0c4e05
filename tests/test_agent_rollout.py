"""Multi-turn rollouts: the environment's tokens are exactly the chat template's, they are attended to but
never trained on, the shared-prompt forward stays exact on trajectories, and episodes are reproducible."""

import pytest
import torch
from transformers import AutoTokenizer

from localrl.config import TrainConfig
from localrl.envs.shell import ShellEnv, expert_call, task_list
from localrl.envs.shell_tasks import generate
from localrl.generation.agent_rollout import TurnFormat, cut_at_tool_call, run_episodes
from localrl.generation.rollout import Rollout, left_pad, stop_token_ids
from localrl.modeling import load_policy, pick_device
from localrl.policy.grpo import policy_update
from localrl.policy.losses import grpo_loss
from localrl.policy.shared_prompt import ConcatForward
from tests.helpers import randomise_lora, rel_err


def test_the_environments_tokens_are_the_chat_templates(tiny_models):
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    fmt = TurnFormat(tok, "You are an agent.")
    turn = tok(expert_call("ls") + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ids = fmt.prompt_ids("List the files.") + turn + fmt.between(turn, "$ ls\na.txt\n[exit code 0]")
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List the files."},
                {"role": "assistant", "content": expert_call("ls")},
                {"role": "user", "content": "<tool_response>\n$ ls\na.txt\n[exit code 0]\n</tool_response>"}]
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids) == want
    # a turn cut at </tool_call> (no end-of-turn token of its own) gets the whole closing from the environment
    cut = tok(expert_call("ls"), add_special_tokens=False)["input_ids"]
    assert tok.decode(fmt.prompt_ids("List the files.") + cut + fmt.between(cut, "$ ls\na.txt\n[exit code 0]")) == want


TOOLS_TEMPLATE = (  # tools in the system block (as Qwen's), tool results in a turn of their own
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_with_tools_gets_the_schema_and_the_tool_role(tiny_models):
    from localrl.generation.agent_rollout import SHELL_TOOL

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    tok.chat_template = TOOLS_TEMPLATE
    fmt = TurnFormat(tok, "You are an agent.")
    assert fmt.tools == [SHELL_TOOL] and fmt.tool_role
    turn = tok(expert_call("ls") + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ids = fmt.prompt_ids("List the files.") + turn + fmt.between(turn, "a.txt\n[exit code 0]")
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List the files."},
                {"role": "assistant", "content": expert_call("ls")}, {"role": "tool", "content": "a.txt\n[exit code 0]"}]
    want = tok.apply_chat_template(messages, tools=[SHELL_TOOL], tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids) == want and '"name": "shell"' in want


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_models):
    from localrl.errors import UserError

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    tok.chat_template = ("{% for m in messages %}{% if loop.last or m.role != 'assistant' %}<|im_start|>{{ m.role }}"
                         "\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}")  # drops all but the last reply
    with pytest.raises(UserError, match="rewrites earlier turns"):
        TurnFormat(tok, None)


def test_a_turn_is_cut_at_the_first_tool_call_end(tiny_models):
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    ids = tok(expert_call("ls") + " and then more text " + expert_call("pwd"), add_special_tokens=False)["input_ids"]
    cut = cut_at_tool_call(tok, ids)
    assert tok.decode(cut).endswith("</tool_call>") and tok.decode(cut).count("<tool_call>") == 1
    assert cut_at_tool_call(tok, ids[:5]) == ids[:5]


def multi_turn_rollout(tok, env_tokens: list[int], tail: list[int]) -> Rollout:
    """One prompt, 3 trajectories: model turn, environment tokens, then ``tail`` (model tokens) on the first."""
    g = torch.Generator().manual_seed(3)
    prompt = tok("Count the files.", add_special_tokens=False)["input_ids"]
    own_a = torch.randint(0, 200, (5,), generator=g).tolist()
    rows = [(own_a + env_tokens + tail, [1] * 5 + [0] * len(env_tokens) + [1] * len(tail)),
            (own_a[:3], [1] * 3),
            (own_a[:4] + env_tokens, [1] * 4 + [0] * len(env_tokens))]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r, _ in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    own = torch.tensor([m + [0] * (width - len(m)) for _, m in rows])
    prompt_ids, prompt_mask = left_pad([prompt], tok.pad_token_id)
    return Rollout(prompt_ids, prompt_mask, ids, mask, torch.zeros(3, dtype=torch.bool), 3, loss_mask=own)


@pytest.fixture
def policy(tiny_models):
    cfg = TrainConfig(model=str(tiny_models["llama"]), quantize="none").validate()
    torch.manual_seed(0)
    model, tok = load_policy(cfg, pick_device("cpu"))
    randomise_lora(model)
    model.train()
    return model, tok


class _NoStep:
    def zero_grad(self, set_to_none=True):
        pass

    def step(self):
        pass


def lora_grads(model, rollout, prompt_cache=True, micro_batch=0):
    model.zero_grad(set_to_none=True)
    cfg = TrainConfig(beta=0.0, max_grad_norm=0.0, temperature=1.0, prompt_cache=prompt_cache).validate()
    policy_update(model, _NoStep(), rollout, torch.tensor([1.0, -0.5, -0.5]), cfg, micro_batch=micro_batch)
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_environment_tokens_change_no_gradient_except_through_later_model_tokens(policy):
    model, tok = policy
    env_a, env_b = [70, 71, 72, 73], [90, 91, 92, 93]
    # environment tokens at the end of every trajectory: nothing after them, so they change nothing
    end_a, end_b = (lora_grads(model, multi_turn_rollout(tok, e, [])) for e in (env_a, env_b))
    assert end_a.keys() == end_b.keys() and len(end_a) > 0
    assert all(torch.equal(end_a[k], end_b[k]) for k in end_a)
    # followed by model tokens, they are attended to: the gradient changes through those tokens only
    mid_a, mid_b = (lora_grads(model, multi_turn_rollout(tok, e, [40, 41, 42])) for e in (env_a, env_b))
    assert any(rel_err(mid_a[k], mid_b[k]) > 1e-3 for k in mid_a)
    # and the loss's gradient with respect to an environment token's log-probability is exactly zero
    rollout = multi_turn_rollout(tok, env_a, [40, 41, 42])
    with ConcatForward(model, rollout) as fwd:
        logp = fwd.logprobs(slice(0, 3))
        logp.retain_grad()
        loss, _ = grpo_loss(logp, logp.detach(), torch.tensor([1.0, -0.5, -0.5]), rollout.trained_mask)
        loss.backward()
    env_positions = rollout.completion_mask.bool() & ~rollout.trained_mask.bool()
    assert env_positions.sum() == 8 and logp.grad[env_positions].abs().max() == 0
    assert logp.grad[rollout.trained_mask.bool()].abs().min() > 0


@pytest.mark.parametrize("micro_batch", [1, 2, 0])
def test_shared_prompt_forward_is_exact_on_trajectories(policy, micro_batch):
    model, tok = policy
    rollout = multi_turn_rollout(tok, [70, 71, 72, 73], [40, 41, 42])
    want = lora_grads(model, rollout, prompt_cache=False, micro_batch=0)
    got = lora_grads(model, rollout, prompt_cache=True, micro_batch=micro_batch)
    assert want.keys() == got.keys()
    assert max(rel_err(got[k], want[k]) for k in want) < 1e-4


def test_episodes_are_reproducible_from_the_generator_seed(policy):
    model, tok = policy
    tasks = [generate(s) for s in range(2)]

    def play(seed):
        out = run_episodes(model, tok, lambda: ShellEnv(task_list(tasks), max_turns=2), [0, 1], 2, 12,
                           stop_token_ids(tok, model), 1.0, torch.Generator().manual_seed(seed), system="Act.")
        return out.rollout.completion_ids.tolist(), out.rollout.loss_mask.tolist(), out.rewards

    first = play(5)
    assert play(5) == first
    assert play(6)[0] != first[0]


def test_episodes_decoded_a_few_tasks_at_a_time_are_the_same_greedy_episodes(policy):
    """The memory plan's ``tasks_at_once`` splits each turn's decoding, not the episodes."""
    model, tok = policy
    tasks = [generate(s) for s in range(3)]

    def play(at_once):
        out = run_episodes(model, tok, lambda: ShellEnv(task_list(tasks), max_turns=2), [0, 1, 2], 2, 12,
                           stop_token_ids(tok, model), 0.0, system="Act.", tasks_at_once=at_once)
        return [ids[mask.bool()].tolist() for ids, mask in zip(out.rollout.completion_ids,
                                                                out.rollout.completion_mask)], out.rewards

    together = play(None)
    assert len(together[0]) == 6 and play(1) == together == play(2)


def test_the_loss_mask_of_real_episodes_covers_exactly_the_tokens_the_model_sampled(monkeypatch):
    """The built-in agent plays shell tasks for a few turns; every turn is recorded where it is sampled. The
    rollout's loss mask is 1 on exactly those tokens (end-of-turn tokens the model wrote included) and 0 on
    everything the environment added: the closing it supplied, the tool output, the next turn's header."""
    import localrl.generation.agent_rollout as agent_rollout
    from localrl.generation.agent_rollout import MAX_OBSERVATION_TOKENS
    from localrl.modeling import load_base, load_tokenizer
    from localrl.models import builtin_path

    path = str(builtin_path("tiny-shell"))
    model, tok = load_base(path, False, pick_device("cpu")), load_tokenizer(path)
    calls = []  # per sampling call: [(context, turn as the episode keeps it)], one per episode still playing
    sample = agent_rollout.sample_groups

    def recorded(model, contexts, group_size, *args, **kwargs):
        r = sample(model, contexts, group_size, *args, **kwargs)
        calls.append([(list(contexts[i // group_size]), cut_at_tool_call(tok, ids[m.bool()].tolist()))
                      for i, (ids, m) in enumerate(zip(r.completion_ids, r.completion_mask))])
        return r

    monkeypatch.setattr(agent_rollout, "sample_groups", recorded)
    tasks = [generate(s) for s in range(3)]
    out = run_episodes(model, tok, lambda: ShellEnv(task_list(tasks), max_turns=3), [0, 1, 2], 2, 32,
                       stop_token_ids(tok, model), 1.0, torch.Generator().manual_seed(0))
    r = out.rollout
    environment_tokens = 0
    for i, e in enumerate(out.episodes):
        prompt = r.prompt_ids[e.prompt][r.prompt_mask[e.prompt].bool()].tolist()
        tokens = r.completion_ids[i][r.completion_mask[i].bool()].tolist()
        assert tokens == e.tokens
        # the k-th sampling call played one turn of every episode with more than k turns, in episode order
        turns = [call[[j for j, other in enumerate(out.episodes) if len(other.texts) > k].index(i)]
                 for k, call in enumerate(calls) if len(e.texts) > k]
        want = [0] * len(tokens)
        for context, turn in turns:
            start = len(context) - len(prompt)
            assert context == prompt + tokens[:start] and tokens[start:start + len(turn)] == turn
            want[start:start + len(turn)] = [1] * len(turn)
        assert r.loss_mask[i].tolist() == want + [0] * (r.loss_mask.size(1) - len(tokens)), i
        assert r.trained_mask[i].tolist() == r.loss_mask[i].tolist()
        # what is left is the environment's: one stretch after each turn but the last, holding its tool output
        stretches, k = [], 0
        while k < len(want):
            end = k
            while end < len(want) and want[end] == want[k]:
                end += 1
            if want[k] == 0:
                stretches.append(tok.decode(tokens[k:end]))
            k = end
        assert len(stretches) == len(e.observations) == len(turns) - 1
        for text, observation in zip(stretches, e.observations):
            if len(tok(observation, add_special_tokens=False)["input_ids"]) <= MAX_OBSERVATION_TOKENS:
                assert observation in text
        environment_tokens += want.count(0)
    assert environment_tokens > 0 and sum(len(e.observations) for e in out.episodes) >= 3
