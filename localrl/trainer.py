"""The GRPO training loop: sample groups, score, compute advantages, update the LoRA adapter.

One step:
  rows (pure function of seed, step) -> G completions per prompt (one prefill per prompt)
  -> rewards -> group-relative advantages -> clipped policy loss (+ beta * KL to the base
  model, whose log-probs come from the same network with the adapter switched off)
  -> ``num_iterations`` AdamW updates -> one metrics record -> a checkpoint every N steps.

The training forward computes each prompt once for its group (prompt_cache.py; with
``prompt_cache=False`` it concatenates prompt and completion per row instead). Deliberate
simplifications: on-policy sampling from the current adapter; one device. Every random
choice is seeded from (seed, step), so a resumed run reproduces an uninterrupted one step
for step.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from localrl.atomic import write_text_atomic
from localrl.checkpoint import latest_checkpoint, load_checkpoint, remove_partial_checkpoints, save_checkpoint
from localrl.config import TrainConfig, build_config, to_toml
from localrl.errors import UserError
from localrl.evaluate import columns_of, evaluate
from localrl.losses import grpo_loss, group_advantages
from localrl.memory import MemoryBudget
from localrl.metrics import Listener, MetricsSink, read_metrics, rewrite_metrics
from localrl.modeling import load_policy, pick_device, resolve_model
from localrl.prompt_cache import ConcatForward, SharedPromptForward
from localrl.rewards import RewardFn, combine, format_reward, resolve_reward, score
from localrl.rollout import Rollout, decode_completions, encode_prompts, sample_groups, stop_token_ids
from localrl.tasks import load_task


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    interrupted: bool
    eval_before: dict | None
    eval_after: dict | None


def _chunks(n: int, size: int) -> list[slice]:
    size = size or n
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def grpo_step(model, optimizer, rollout: Rollout, advantages: torch.Tensor, cfg: TrainConfig,
              micro_batch: int = 0, logits_chunk: int = 1024) -> dict:
    """The policy update of one step on a finished rollout, ``micro_batch`` completions at a time (0: all)."""
    device = next(model.parameters()).device
    n = rollout.completion_ids.size(0)
    chunks = _chunks(n, micro_batch)
    mask = rollout.completion_mask.to(device)
    adv = advantages.to(device)
    forward = SharedPromptForward if cfg.prompt_cache else ConcatForward

    def frozen_logprobs(disable_adapter: bool) -> list[torch.Tensor]:
        with torch.no_grad(), (model.disable_adapter() if disable_adapter else nullcontext()), \
                forward(model, rollout, cfg.temperature, logits_chunk) as fwd:
            return [fwd.logprobs(c) for c in chunks]

    ref = frozen_logprobs(True) if cfg.beta > 0 else None
    old = frozen_logprobs(False) if cfg.num_iterations > 1 else None
    totals = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0}
    for _ in range(cfg.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        with forward(model, rollout, cfg.temperature, logits_chunk) as fwd:  # leaving it finishes the prompt backward
            for i, c in enumerate(chunks):
                logp = fwd.logprobs(c)
                old_logp = old[i] if old is not None else logp.detach()
                loss, stats = grpo_loss(logp, old_logp, adv[c], mask[c], cfg.epsilon,
                                        ref[i] if ref is not None else None, cfg.beta)
                (loss / n).backward()
                weight = (c.stop - c.start) / n / cfg.num_iterations
                totals["loss"] += loss.item() / n / cfg.num_iterations
                totals["kl"] += stats.get("kl", 0.0) * weight
                totals["clip_frac"] += stats["clip_frac"] * weight
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm)
        optimizer.step()
    if cfg.beta == 0:
        totals["kl"] = None
    return totals


class _StopFlag:
    """First Ctrl-C asks the loop to stop after the current step (and save); a second one aborts."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def default_rewards(cfg: TrainConfig) -> tuple[list[RewardFn], list[float]]:
    """The correctness reward named in the config, then the weighted format reward."""
    return [resolve_reward(cfg.reward), format_reward], [1.0, cfg.format_weight]


def _new_run_dir(cfg: TrainConfig) -> Path:
    run_dir = Path(cfg.run_dir or f"runs/{datetime.now():%Y%m%d-%H%M%S}")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"run_dir {run_dir}: already exists; continue it with --resume {run_dir}")
    return run_dir


def resume_config(run_dir: str | Path, overrides: dict | None = None) -> TrainConfig:
    """The saved config of a run, with ``overrides`` (for example more steps) applied."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise UserError(f"resume {run_dir}: not a run directory (no config.toml)")
    cfg = build_config(path, overrides)
    cfg.run_dir = str(run_dir)
    return cfg


def preflight(cfg: TrainConfig):
    """The checks a run makes before any weights load (config, reward, data, model name); returns the task."""
    cfg.validate()
    resolve_reward(cfg.reward)
    resolve_model(cfg.model)
    return load_task(cfg.data, cfg.eval_data, cfg.eval_size)


def train(cfg: TrainConfig, rewards: tuple[list[RewardFn], list[float]] | None = None,
          listeners: list[Listener] | tuple = (), resume: bool = False, log=print) -> RunResult:
    """Run GRPO as configured; with ``resume``, continue ``cfg.run_dir`` from its last checkpoint."""
    task = preflight(cfg)  # bad config, data or model name stops here, before the model loads
    reward_fns, weights = rewards or default_rewards(cfg)
    run_dir = Path(cfg.run_dir) if resume else _new_run_dir(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = pick_device(cfg.device)
    budget = MemoryBudget.for_run(cfg, task, device) if cfg.memory_budget else None  # before any weight loads
    torch.manual_seed(cfg.seed)
    model, tok = load_policy(cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.toml", to_toml(cfg))
    metrics_path = run_dir / "metrics.jsonl"
    start, history = 0, []
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        start = load_checkpoint(ckpt, model, optimizer)
        log(f"resumed {run_dir} from {ckpt.name}")
    remove_partial_checkpoints(run_dir)
    if resume:  # steps after the checkpoint will be recomputed: drop their records
        history = [r for r in read_metrics(metrics_path) if (r.get("kind") == "train" and r["step"] <= start)
                   or (r.get("kind") == "eval" and r.get("when") == "before")]
        rewrite_metrics(metrics_path, history)
    sink = MetricsSink(metrics_path, listeners)
    stops = stop_token_ids(tok, model)
    eval_args = (reward_fns, weights, cfg.max_new_tokens, cfg.eval_batch_size)

    eval_before = next((r for r in history if r.get("kind") == "eval" and r.get("when") == "before"), None)
    if eval_before is None and cfg.eval_size and task.held_out:
        eval_before = {"kind": "eval", "when": "before", "step": 0, **evaluate(model, tok, task.held_out, *eval_args)}
        sink.emit(eval_before)

    interrupted, done, t_run = False, start, time.time()
    wall_offset = max((r.get("wall_time", 0.0) for r in history if r.get("kind") == "train"), default=0.0)
    try:
        with _StopFlag() as stop_flag:
            for step in range(start, cfg.steps):
                record = train_step(model, tok, optimizer, task, step, cfg, reward_fns, weights, stops, budget)
                record["wall_time"] = round(wall_offset + time.time() - t_run, 3)
                sink.emit(record)
                done = step + 1
                if stop_flag.requested or done % cfg.save_every == 0 or done == cfg.steps:
                    save_checkpoint(run_dir, done, model, optimizer, cfg.keep_checkpoints)
                if stop_flag.requested:
                    interrupted = True
                    log(f"interrupted: saved checkpoint at step {done}; continue with --resume {run_dir}")
                    break
        eval_after = None
        if not interrupted and cfg.eval_size and task.held_out:
            eval_after = {"kind": "eval", "when": "after", "step": done,
                          **evaluate(model, tok, task.held_out, *eval_args)}
            sink.emit(eval_after)
    finally:
        sink.close()
    return RunResult(run_dir, done, interrupted, eval_before, eval_after)


def train_step(model, tok, optimizer, task, step: int, cfg: TrainConfig,
               reward_fns: list[RewardFn], weights: list[float], stops: list[int], budget=None) -> dict:
    """One whole GRPO step (sample, score, update) on ``task``'s rows of ``step``; returns its metrics record."""
    t0 = time.time()
    rows = task.sample(step, cfg.prompts_per_step, cfg.seed)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + step)
    model.eval()
    rollout = sample_groups(model, encode_prompts(tok, rows), cfg.group_size, cfg.max_new_tokens, stops,
                            tok.pad_token_id, cfg.temperature, generator)
    t_gen = time.time() - t0
    scores = score(reward_fns, decode_completions(tok, rollout), columns_of(rows, cfg.group_size))
    rewards = torch.tensor(combine(scores, weights), dtype=torch.float64)  # [B*G]
    advantages = group_advantages(rewards, cfg.group_size).float()
    model.train()
    micro_batch, logits_chunk = cfg.micro_batch_size, 1024
    if budget is not None:  # re-plan for this batch's real lengths; refuse before running if it cannot fit
        plan = budget.plan(rollout.prompt_ids.size(1), rollout.completion_ids.size(1))
        if not plan.fits:
            raise UserError(f"step {step + 1}: predicted peak {plan.peak_bytes / 2**30:.2f} GiB exceeds "
                            f"memory_budget {cfg.memory_budget} (prompt {rollout.prompt_ids.size(1)} tokens)")
        micro_batch, logits_chunk = plan.micro_batch, plan.logits_chunk
        if plan.checkpointing:
            budget.enable_checkpointing(model)
    stats = grpo_step(model, optimizer, rollout, advantages, cfg, micro_batch, logits_chunk)
    elapsed = time.time() - t0
    gen_tokens = int(rollout.completion_mask.sum())
    return {
        "kind": "train",
        "step": step + 1,
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        "accuracy": sum(s == 1.0 for s in scores[0]) / len(scores[0]),
        "loss": stats["loss"],
        "kl": stats["kl"],
        "clip_frac": stats["clip_frac"],
        "completion_len": gen_tokens / rollout.completion_ids.size(0),
        "truncated": rollout.truncated.float().mean().item(),
        "tokens_per_s": gen_tokens / max(elapsed, 1e-9),
        "gen_s": round(t_gen, 3),
        "step_s": round(elapsed, 3),
        "lr": optimizer.param_groups[0]["lr"],
        "micro_batch": micro_batch or rollout.completion_ids.size(0),
        "peak_mem_mb": _peak_memory_mb(device),
    }


def _peak_memory_mb(device: torch.device) -> float:
    """Peak allocated GPU memory, or on CPU the process's peak resident set (what a watcher can act on)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
