"""Held-out evaluation: greedy pass@1 accuracy and mean reward, of a model in memory
(``evaluate``, which training calls) or of a run's adapter or a base model (``evaluate_policy``,
which ``localrl eval`` calls).

Accuracy counts completions whose correctness reward (the first reward function) is 1;
the mean reward adds the weighted format reward, exactly as in training. Where completions state a
confidence (``<confidence>`` tags, calibration.py), the result also has their expected calibration
error (``ece``, 10 bins), Brier score, mean confidence, the share that stated one and the
reliability bins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from localrl.calibration import calibration_summary
from localrl.errors import UserError
from localrl.metrics import item_progress
from localrl.rewards import RewardFn, combine, reward_names, score
from localrl.rollout import (Rollout, completion_token_ids, decode_completions, encode_prompts, sample_groups,
                             stop_token_ids)

Generate = Callable[[list[list[int]]], Rollout]  # prompts (token ids) -> one greedy completion each


def columns_of(rows: list[dict], repeat: int = 1) -> dict[str, list]:
    """Dataset columns as lists aligned with completions (each row repeated ``repeat`` times)."""
    keys = sorted({k for r in rows for k in r})
    return {k: [r.get(k) for r in rows for _ in range(repeat)] for k in keys}


@torch.no_grad()
def evaluate(model, tok, rows: list[dict], rewards: list[RewardFn], weights: list[float],
             max_new_tokens: int, batch_size: int = 64, progress: Callable[[int, int], None] | None = None,
             system: str | None = None, samples: int = 0, generate: Generate | None = None) -> dict:
    """Greedy pass@1 over ``rows`` (each given the ``system`` message, if any); ``progress(done, total)`` at
    each batch's start and, within a batch, as its items are decoded (``item_progress``: at most once a
    second). With ``samples``, the first few completions come back too,
    each with its prompt, reference answer and rewards, so a user can see why a model scores as it does.
    ``generate``: who decodes (training passes its llama.cpp sampler); by default the torch model does."""
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
    return {**out, "samples": shown} if samples else out


def experience_of(run: str | Path | None, experience: str | Path | None = None):
    """The experience library to evaluate with: ``experience`` (a run directory, an experience.json or a
    .txt of lessons), else that of ``run`` when it is a training-free GRPO run, else None."""
    from localrl.experience import load_library
    from localrl.runs import Run

    if experience:
        return load_library(experience)
    return load_library(run) if run is not None and Run(run).experience_path.is_file() else None


def evaluate_policy(cfg, run: str | Path | None = None,
                    progress: Callable[[int, int], None] | None = None, samples: int = 3,
                    experience: str | Path | None = None) -> dict:
    """Held-out figures of a run's newest adapter (``run``) or of ``cfg.model``, through the sampler ``cfg``
    selects, exactly as the run's own evaluations have them (the same decoding: Markovian traces, episodes in
    the environment, llama.cpp's greedy decoding of a run that sampled with it): {"model": what was
    evaluated, "accuracy", "reward_mean", "n", ..., "samples"}. A training-free GRPO run is evaluated with its
    experience library's lessons in the system message, and any model with ``experience``'s (a run
    directory, an experience.json or a .txt of lessons)."""
    from localrl.modeling import default_4bit, load_base, load_config, load_tokenizer, pick_device
    from localrl.runs import Run
    from localrl.samplers import ModelInfo, sampler_for

    cfg.validate()
    sampler = sampler_for(cfg)(cfg)
    if run is not None:  # an adapter is evaluated on what it was trained for, or the number means nothing
        trained = Run.open(run).read_config()
        was = sampler_for(trained)(trained)
        if (trained.env, type(was)) != (cfg.env, type(sampler)):
            raise UserError(f"eval {run}: the run was trained {was.describe_eval()}; evaluating it "
                            f"{sampler.describe_eval()} measures nothing it learned (leave --env and "
                            f"markovian_chunk as the run had them)", field="env")
    if cfg.env and experience:
        raise UserError("eval --experience: an experience library is for single-turn tasks (not env)")
    device = pick_device(cfg.device)
    path, config = load_config(cfg.model)
    tok = load_tokenizer(path)
    plan = sampler.prepare(ModelInfo(path, config, tok, getattr(config, "max_position_embeddings", None), device)
                           if run is not None else None)
    sampler.require_held_out()
    library = None if cfg.env else experience_of(run, experience)
    in_4bit = default_4bit(cfg.quantize, device)
    if run is not None:
        model, tok, ckpt = Run.open(run).load_adapter(device, in_4bit, cfg)
        what = f"{run} ({ckpt.name})"
    else:
        model, what = load_base(path, in_4bit, device), cfg.model
    if library is not None:  # a training-free GRPO run: the lessons it learned, as it gave them
        what += f" with the {len(library.lessons)} lessons of {experience or 'its experience library'}"
    if run is not None and plan.backend != "torch":  # as the run decoded: its sampler's backend
        sampler.start(model, tok, None)
    try:
        result = sampler.evaluate(model, tok, progress, cfg.eval_batch_size,
                                  library.system if library is not None else (lambda s: s), samples)
    finally:
        sampler.close()
    return {"model": what, **result}
