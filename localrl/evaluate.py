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


def _setting(cfg) -> str:
    return f"in the {cfg.env} environment" if cfg.env else f"on single-turn prompts ({cfg.data})"


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
    """Held-out greedy accuracy of a run's newest adapter (``run``) or of ``cfg.model`` on ``cfg``'s
    task and rewards: {"model": what was evaluated, "accuracy", "reward_mean", "n", "samples"}; with
    ``cfg.env``, the success rate of greedy episodes on the environment's held-out tasks, per family too. A
    training-free GRPO run is evaluated with its experience library's lessons in the system message, and any
    model with ``experience``'s (a run directory, an experience.json or a .txt of lessons)."""
    from localrl.modeling import default_4bit, load_base, load_config, load_tokenizer, pick_device
    from localrl.rewards import config_rewards
    from localrl.runs import Run
    from localrl.tasks import load_task, system_prompt

    cfg.validate()
    if run is not None:  # an adapter is evaluated on what it was trained for, or the number means nothing
        trained = Run.open(run).read_config()
        if trained.env != cfg.env:
            raise UserError(f"eval {run}: the run was trained {_setting(trained)}; evaluating it {_setting(cfg)} "
                            f"measures nothing it learned (leave --env as the run had it)", field="env")
    library = None
    if cfg.env and experience:
        raise UserError("eval --experience: an experience library is for single-turn tasks (not env)")
    if cfg.env:
        from localrl.agent_train import env_setup, evaluate_episodes

        setup = env_setup(cfg)
        if not setup.held_out:
            raise UserError(f"env_tasks {cfg.env_tasks}: no held-out tasks to evaluate on", field="env_tasks")
    else:
        rewards, weights = config_rewards(cfg)
        task = load_task(cfg.data, cfg.eval_data, cfg.eval_size, system=system_prompt(cfg.system_prompt, cfg.model,
                                                                                cfg.calibration_weight > 0))
        if not task.held_out:
            raise UserError(f"data {cfg.data}: no held-out rows to evaluate on (eval_size is {cfg.eval_size}; "
                            f"pass --eval-size N)", field="eval_size")
        library = experience_of(run, experience)
        if library is not None:  # a training-free GRPO run: the lessons it learned, as it gave them
            task.system = library.system(task.system)
    device = pick_device(cfg.device)
    in_4bit = default_4bit(cfg.quantize, device)
    if run is not None:
        model, tok, ckpt = Run.open(run).load_adapter(device, in_4bit, cfg)
        what = f"{run} ({ckpt.name})"
    else:
        path, _ = load_config(cfg.model)
        model, tok, what = load_base(path, in_4bit, device), load_tokenizer(path), cfg.model
    if library is not None:
        what += f" with the {len(library.lessons)} lessons of {experience or 'its experience library'}"
    if cfg.env:
        context = getattr(model.config, "max_position_embeddings", None) or 2048
        result = evaluate_episodes(model, tok, setup, cfg, stop_token_ids(tok, model), context, progress,
                                   cfg.eval_batch_size, samples)
    else:
        result = evaluate(model, tok, task.held_out, rewards, weights, cfg.max_new_tokens, cfg.eval_batch_size,
                          progress, task.system, samples)
    return {"model": what, **result}
