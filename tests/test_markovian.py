"""Markovian thinking (Delethink): contexts never exceed query + C + m while traces span more than three
chunks, each chunk is the previous one's carry plus its own tokens, the log-probabilities the update uses
equal a direct computation in the same contexts, sampling is reproducible, and the mode trains."""

from __future__ import annotations

import pytest
import torch

from localrl.config import TrainConfig
from localrl.data import load_task
from localrl.errors import UserError
from localrl.generation.markovian import chunk_context, sample_markovian, trace_rollout
from localrl.generation.rollout import encode_prompts, stop_token_ids
from localrl.modeling import load_policy
from localrl.policy.shared_prompt import ConcatForward, SharedPromptForward
from localrl.training.settings import check_config
from tests.helpers import QUIET, small, train_records

C, M = 8, 4


@pytest.fixture(scope="module")
def policy(builtin_model):
    cfg = TrainConfig(quantize="none").validate()
    torch.manual_seed(0)
    model, tok = load_policy(cfg, torch.device("cpu"))
    model.eval()
    task = load_task("arith", eval_size=0)
    prompts = encode_prompts(tok, task.sample(0, 3, 0), task.system)
    return model, tok, prompts, stop_token_ids(tok, model)


def test_contexts_stay_within_query_plus_chunk_plus_carry_over_many_chunks(policy):
    model, tok, prompts, stops = policy
    chunks = sample_markovian(model, prompts, 2, C, M, 48, stops, tok.pad_token_id, 1.0, seed=3)
    r = chunks.rollout
    assert int(chunks.index.max()) >= 3  # some trace spans more than three chunks
    previous = {}
    for row in range(r.completion_ids.size(0)):
        trace, k = int(chunks.trace[row]), int(chunks.index[row])
        query = prompts[trace // 2]
        context = r.prompt_ids[row][r.prompt_mask[row].bool()].tolist()
        tokens = r.completion_ids[row][r.completion_mask[row].bool()].tolist()
        assert len(context) + len(tokens) <= len(query) + C + M
        assert len(tokens) <= C
        assert context == chunk_context(query, previous.get(trace), M)  # the query, then the last M tokens
        previous[trace] = tokens
    # each trace is its chunks in order
    for t, trace in enumerate(chunks.traces):
        rows = (chunks.trace == t).nonzero().flatten().tolist()
        assert sum((r.completion_ids[i][r.completion_mask[i].bool()].tolist() for i in rows), []) == trace
        assert len(trace) <= 48
    whole = trace_rollout(chunks, prompts, 2, tok.pad_token_id)
    assert whole.completion_mask.sum(1).tolist() == [len(t) for t in chunks.traces]


def test_the_chunk_log_probabilities_are_those_of_their_contexts(policy):
    model, tok, prompts, stops = policy
    chunks = sample_markovian(model, prompts, 2, C, M, 40, stops, tok.pad_token_id, 1.0, seed=5)
    r = chunks.rollout
    direct = []
    with torch.no_grad():
        for row in range(r.completion_ids.size(0)):
            context = r.prompt_ids[row][r.prompt_mask[row].bool()]
            tokens = r.completion_ids[row][r.completion_mask[row].bool()]
            logits = model(torch.cat([context, tokens])[None]).logits[0, len(context) - 1:-1].float()
            direct.append(torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))
        for forward in (SharedPromptForward, ConcatForward):
            with forward(model, r) as fwd:
                logp = fwd.logprobs(slice(0, r.completion_ids.size(0)))  # [rows, C]
            for row, want in enumerate(direct):
                assert torch.allclose(logp[row, :len(want)], want, atol=1e-5), (forward.__name__, row)


def test_markovian_sampling_is_reproducible_from_the_seed(policy):
    model, tok, prompts, stops = policy
    a = sample_markovian(model, prompts, 2, C, M, 32, stops, tok.pad_token_id, 1.0, seed=9)
    b = sample_markovian(model, prompts, 2, C, M, 32, stops, tok.pad_token_id, 1.0, seed=9)
    c = sample_markovian(model, prompts, 2, C, M, 32, stops, tok.pad_token_id, 1.0, seed=10)
    assert a.traces == b.traces and a.traces != c.traces


@pytest.mark.parametrize("kw, message", [
    (dict(markovian_chunk=8, markovian_carry=8), "config field markovian_carry: must be non-negative and below"),
    (dict(markovian_chunk=8, env="shell"), "Markovian thinking is for single-turn tasks"),
    (dict(markovian_chunk=8, rollout="llama.cpp"), "samples with torch"),
])
def test_bad_markovian_settings_are_one_line(kw, message):
    with pytest.raises(UserError, match=message):
        check_config(TrainConfig(**kw))


@pytest.mark.slow
def test_the_markovian_mode_trains_with_reward_rising(builtin_model, tmp_path):
    from localrl.training.loop import train

    cfg = small(tmp_path / "run", steps=16, prompts_per_step=8, group_size=8, max_new_tokens=64,
                markovian_chunk=16, markovian_carry=12, seed=0)
    train(cfg, **QUIET)
    records = train_records(tmp_path / "run")
    longest_query = max(len(ids) for ids in encode_prompts(load_policy(cfg, torch.device("cpu"))[1],
                                                            [{"prompt": "What is 9999 + 9999?"}]))
    assert all(r["max_context"] <= longest_query + 16 + 12 for r in records)
    assert sum(r["chunks_per_trace"] for r in records) / len(records) > 2  # traces cross chunk boundaries
    early = sum(r["reward_mean"] for r in records[:8]) / 8
    late = sum(r["reward_mean"] for r in records[-8:]) / 8
    assert late > early + 0.05, [round(r["reward_mean"], 3) for r in records]  # measured here: 0.342 -> 0.437
