"""Held-out evaluation: greedy pass@1 accuracy and mean reward.

Accuracy counts completions whose correctness reward (the first reward function) is 1;
the mean reward adds the weighted format reward, exactly as in training.
"""

from __future__ import annotations

import torch

from localrl.rewards import RewardFn, combine, score
from localrl.rollout import decode_completions, encode_prompts, sample_groups, stop_token_ids


def columns_of(rows: list[dict], repeat: int = 1) -> dict[str, list]:
    """Dataset columns as lists aligned with completions (each row repeated ``repeat`` times)."""
    keys = sorted({k for r in rows for k in r})
    return {k: [r.get(k) for r in rows for _ in range(repeat)] for k in keys}


@torch.no_grad()
def evaluate(model, tok, rows: list[dict], rewards: list[RewardFn], weights: list[float],
             max_new_tokens: int, batch_size: int = 64) -> dict:
    was_training = model.training
    model.eval()
    stops = stop_token_ids(tok, model)
    correct, total = [], []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        rollout = sample_groups(model, encode_prompts(tok, chunk), 1, max_new_tokens, stops,
                                tok.pad_token_id, temperature=0.0)
        scores = score(rewards, decode_completions(tok, rollout), columns_of(chunk))
        correct += [float(s == 1.0) for s in scores[0]]
        total += combine(scores, weights)
    model.train(was_training)
    n = len(rows)
    return {"accuracy": sum(correct) / max(n, 1), "reward_mean": sum(total) / max(n, 1), "n": n}
