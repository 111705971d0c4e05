"""Held-out evaluation: greedy pass@1 accuracy and mean reward, of a model in memory
(``evaluate``, which training calls) or of a run's adapter or a base model (``evaluate_policy``,
which ``localrl eval`` calls).

Accuracy counts completions whose correctness reward (the first reward function) is 1;
the mean reward adds the weighted format reward, exactly as in training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from localrl.errors import UserError
from localrl.rewards import RewardFn, combine, score
from localrl.rollout import decode_completions, encode_prompts, sample_groups, stop_token_ids


def columns_of(rows: list[dict], repeat: int = 1) -> dict[str, list]:
    """Dataset columns as lists aligned with completions (each row repeated ``repeat`` times)."""
    keys = sorted({k for r in rows for k in r})
    return {k: [r.get(k) for r in rows for _ in range(repeat)] for k in keys}


@torch.no_grad()
def evaluate(model, tok, rows: list[dict], rewards: list[RewardFn], weights: list[float],
             max_new_tokens: int, batch_size: int = 64, progress: Callable[[int, int], None] | None = None) -> dict:
    """Greedy pass@1 over ``rows``; ``progress(done, total)`` is called before and after each batch."""
    was_training = model.training
    model.eval()
    stops = stop_token_ids(tok, model)
    correct, total = [], []
    for i in range(0, len(rows), batch_size):
        if progress is not None:
            progress(i, len(rows))
        chunk = rows[i:i + batch_size]
        rollout = sample_groups(model, encode_prompts(tok, chunk), 1, max_new_tokens, stops,
                                tok.pad_token_id, temperature=0.0)
        scores = score(rewards, decode_completions(tok, rollout), columns_of(chunk))
        correct += [float(s == 1.0) for s in scores[0]]
        total += combine(scores, weights)
    if progress is not None:
        progress(len(rows), len(rows))
    model.train(was_training)
    n = len(rows)
    return {"accuracy": sum(correct) / max(n, 1), "reward_mean": sum(total) / max(n, 1), "n": n}


def evaluate_policy(cfg, run: str | Path | None = None,
                    progress: Callable[[int, int], None] | None = None) -> dict:
    """Held-out greedy accuracy of a run's newest adapter (``run``) or of ``cfg.model`` on ``cfg``'s
    task and rewards: {"model": what was evaluated, "accuracy", "reward_mean", "n"}."""
    from localrl.modeling import load_base, load_config, load_tokenizer, pick_device
    from localrl.rewards import default_rewards
    from localrl.runs import Run
    from localrl.tasks import load_task

    cfg.validate()
    rewards, weights = default_rewards(cfg.reward, cfg.format_weight)
    task = load_task(cfg.data, cfg.eval_data, cfg.eval_size)
    if not task.held_out:
        raise UserError(f"data {cfg.data}: no held-out rows to evaluate on (eval_size is {cfg.eval_size}; "
                        f"pass --eval-size N)", field="eval_size")
    device = pick_device(cfg.device)
    if run is not None:
        model, tok, ckpt = Run.open(run).load_adapter(device, cfg.load_in_4bit, cfg)
        what = f"{run} ({ckpt.name})"
    else:
        path, _ = load_config(cfg.model)
        model, tok, what = load_base(path, cfg.load_in_4bit, device), load_tokenizer(path), cfg.model
    result = evaluate(model, tok, task.held_out, rewards, weights, cfg.max_new_tokens, cfg.eval_batch_size, progress)
    return {"model": what, **result}
