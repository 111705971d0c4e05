"""Held-out evaluation of prompt completions: greedy pass@1 accuracy and mean reward of a model in memory, as
the completions and Markovian samplers decode held-out problems (a run's own evaluations, and ``localrl eval``
through ``localrl.commands.eval.evaluate_policy``).

Accuracy counts completions whose correctness reward (the first reward function) is 1;
the mean reward adds the weighted format reward, exactly as in training. Where completions state a
confidence (``<confidence>`` tags, calibration.py), the result also has their expected calibration
error (``ece``, 10 bins), Brier score, mean confidence, the share that stated one and the
reliability bins.
"""

from __future__ import annotations

from typing import Callable

import torch

from localrl.data.calibration import calibration_summary
from localrl.data.rewards import RewardFn, combine, reward_names, score
from localrl.generation.rollout import (Rollout, completion_token_ids, decode_completions, encode_prompts,
                                        sample_groups, stop_token_ids)
from localrl.metrics import item_progress

Generate = Callable[[list[list[int]]], Rollout]  # prompts (token ids) -> one greedy completion each


def columns_of(rows: list[dict], repeat: int = 1) -> dict[str, list]:
    """Dataset columns as lists aligned with completions (each row repeated ``repeat`` times)."""
    keys = sorted({k for r in rows for k in r})
    return {k: [r.get(k) for r in rows for _ in range(repeat)] for k in keys}


@torch.no_grad()
def evaluate(model, tok, rows: list[dict], rewards: list[RewardFn], weights: list[float],
             max_new_tokens: int, batch_size: int = 64, progress: Callable[[int, int], None] | None = None,
             system: str | None = None, samples: int = 0, generate: Generate | None = None,
             per_row: bool = False) -> dict:
    """Greedy pass@1 over ``rows`` (each given the ``system`` message, if any); ``progress(done, total)`` at
    each batch's start and, within a batch, as its items are decoded (``item_progress``: at most once a
    second). With ``samples``, the first few completions come back too,
    each with its prompt, reference answer and rewards, so a user can see why a model scores as it does.
    ``generate``: who decodes (training passes its llama.cpp sampler); by default the torch model does. With
    ``per_row``, ``correct`` lists each row's 0 or 1 (for paired comparisons of two models on the same rows)."""
    was_training = model.training
    model.eval()
    items = item_progress(progress)  # within a batch: at most once a second; each batch's start always
    start = 0  # the first item of the batch being decoded
    if generate is None:
        stops = stop_token_ids(tok, model)

        def generate(prompts: list[list[int]]) -> Rollout:
            within = None if items is None else (lambda share: items(start + int(share * len(prompts)), len(rows)))
            return sample_groups(model, prompts, 1, max_new_tokens, stops, tok.pad_token_id, temperature=0.0,
                                 on_token=within)
    correct, total, shown, tokens, all_texts = [], [], [], 0, []
    for start in range(0, len(rows), batch_size):
        if progress is not None:
            progress(start, len(rows))
        chunk = rows[start:start + batch_size]
        rollout = generate(encode_prompts(tok, chunk, system))
        texts = decode_completions(tok, rollout)
        scores = score(rewards, texts, {**columns_of(chunk), "completion_ids": completion_token_ids(rollout)})
        correct += [float(s == 1.0) for s in scores[0]]
        all_texts += texts
        total += combine(scores, weights)
        tokens += int(rollout.completion_mask.sum())
        for row, text, *each in zip(chunk, texts, *scores):
            if len(shown) < samples:
                shown.append({"prompt": row["prompt"], "answer": row["answer"], "completion": text,
                              "rewards": {name: round(x, 4) for name, x in zip(reward_names(rewards), each)}})
    if progress is not None:
        progress(len(rows), len(rows))
    model.train(was_training)
    n = len(rows)
    out = {"accuracy": sum(correct) / max(n, 1), "reward_mean": sum(total) / max(n, 1),
           "completion_len": tokens / max(n, 1), "n": n}
    calibration = calibration_summary(all_texts, correct)
    if calibration is not None:
        out.update({k if k != "stated" else "confidence_stated": v for k, v in calibration.items()})
    if per_row:
        out["correct"] = correct
    return {**out, "samples": shown} if samples else out
