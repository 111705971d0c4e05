"""``localrl steer RUN_DIR``: steering vectors from a run's adapter (localrl/policy/steering.py), added to the
frozen base at a few positions; held-out accuracy of the base, the steered base and the trained run on the same
problems, and the share of the base-to-trained gap the vectors recover, with a paired bootstrap interval."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from localrl.errors import UserError


def add_parser(commands) -> None:
    p = commands.add_parser("steer", help="steering vectors from a run's adapter: how much of the run's gain they "
                            "recover in the frozen base, at a few positions")
    p.add_argument("run", help="a trained run directory (its newest adapter; single-turn completions)")
    p.add_argument("--selector", action="append", choices=["learned", "starts", "all"],
                   help="where to steer, beside the last prompt position: learned (after the tokens where the run's "
                        "next-token distribution differs most from the base's, --share of the positions; the "
                        "default), starts (after each token that ends a line or a sentence) or all (every "
                        "position); repeatable, to compare")
    p.add_argument("--share", type=float, default=0.12,
                   help="the share of positions the learned selector's tokens cover on the fitting text (default "
                        "0.12, as the paper steers)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every vector (default 1)")
    p.add_argument("--fit-size", type=int, default=64,
                   help="training prompts the trained model completes to fit the vectors on (default 64)")
    p.add_argument("--eval-size", type=int, default=None, help="held-out problems (default: the run's)")
    p.add_argument("--out", metavar="FILE.safetensors", help="write the vectors of the first selector here")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(func=cmd_steer)


def gap_share(base: list[float], steered: list[float], trained: list[float], draws: int = 4000,
              seed: int = 0) -> dict:
    """(steered - base) / (trained - base) over the same problems, and its 95% interval from a paired bootstrap
    (the problems resampled together); a resample whose gap is 0 is left out. None where the gap itself is 0."""
    import numpy as np

    b, s, t = (np.asarray(x, dtype=float) for x in (base, steered, trained))
    gap = t.mean() - b.mean()
    if gap == 0:
        return {"share": None, "ci95": None}
    picks = np.random.default_rng(seed).integers(0, len(b), (draws, len(b)))
    gaps = t[picks].mean(1) - b[picks].mean(1)
    keep = gaps != 0
    shares = (s[picks].mean(1) - b[picks].mean(1))[keep] / gaps[keep]
    lo, hi = np.percentile(shares, [2.5, 97.5])
    return {"share": float((s.mean() - b.mean()) / gap), "ci95": [float(lo), float(hi)]}


def cmd_steer(args: argparse.Namespace) -> int:
    selectors = list(dict.fromkeys(args.selector or ["learned"]))
    if not 0 < args.share <= 1:
        raise UserError(f"steer: --share must be above 0 and at most 1 (got {args.share})")
    if args.fit_size < 1:
        raise UserError(f"steer: --fit-size must be at least 1 (got {args.fit_size})")
    if not (args.scale == args.scale and abs(args.scale) < 1e6):
        raise UserError(f"steer: --scale must be a finite number (got {args.scale})")
    if args.out and not args.out.endswith(".safetensors"):
        raise UserError(f"steer: --out {args.out}: the vectors are written as safetensors (FILE.safetensors)")
    result = steer(args.run, selectors, args.scale, args.fit_size, args.eval_size, args.out, args.share)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}: {result['n']} held-out problems")
    print(f"  base               {result['base']:6.1%}")
    for name, r in result["steered"].items():
        share = "n/a (no gap)" if r["share"] is None else \
            f"{r['share']:.0%} of the gap [95% CI {r['ci95'][0]:.0%}, {r['ci95'][1]:.0%}]"
        print(f"  steered ({name:<7}) {r['accuracy']:6.1%}  {share}; {r['positions']:.1%} of positions steered")
    print(f"  trained            {result['trained']:6.1%}")
    if args.out:
        print(f"wrote {args.out}")
    return 0


def steer(run: str, selectors: list[str], scale: float, fit_size: int, eval_size: int | None,
          out: str | None = None, share: float = 0.12) -> dict:
    """Fit the vectors of each selector on the run's own completions of ``fit_size`` training prompts, and measure
    base, steered base and trained run on the held-out problems."""
    from localrl.evaluation.evaluate import evaluate
    from localrl.modeling import default_4bit, load_config, pick_device
    from localrl.policy.steering import SteeredModel
    from localrl.runs import Run
    from localrl.samplers import ModelInfo, sampler_for
    from localrl.samplers.completions import Completions
    from localrl.training.settings import read_run_config

    source = Run.open(run)
    cfg = read_run_config(source, {} if eval_size is None else {"eval_size": eval_size})
    sampler = sampler_for(cfg)(cfg)
    if cfg.env or type(sampler) is not Completions:
        raise UserError(f"steer {run}: the run was trained {sampler.describe_eval()}; steering vectors are "
                        f"measured on single-turn completions")
    device = pick_device(cfg.device)
    path, config = load_config(cfg.model)
    model, tok, ckpt = source.load_adapter(device, default_4bit(cfg.quantize, device), cfg)
    sampler.prepare(ModelInfo(path, config, tok, getattr(config, "max_position_embeddings", None), device))
    sampler.require_held_out()
    model.eval()
    task, (fns, weights) = sampler.task, sampler.scored_rewards()
    chunks = fitting_text(model, tok, task.sample(0, fit_size, cfg.seed), task.system, cfg.max_new_tokens,
                          cfg.eval_batch_size)
    vectors = {selector: fit(model, tok, chunks, selector, share) for selector in selectors}

    def held_out() -> dict:
        return evaluate(model, tok, task.held_out, fns, weights, cfg.max_new_tokens, cfg.eval_batch_size,
                        system=task.system, per_row=True)

    trained = held_out()
    with model.disable_adapter():
        base = held_out()
        steered = {}
        for selector, v in vectors.items():
            steering = SteeredModel(model, v, scale)
            with steering.on():
                r = held_out()
            steered[selector] = {"accuracy": r["accuracy"], "positions": steering.share, "fit_positions": v.positions,
                                 "tokens": None if v.tokens is None else len(v.tokens),
                                 **gap_share(base["correct"], r["correct"], trained["correct"])}
    if out:
        save_vectors(vectors[selectors[0]], Path(out), {"scale": str(scale), "run": str(run), "checkpoint": ckpt.name})
    return {"model": f"{run} ({ckpt.name})", "n": base["n"], "base": base["accuracy"], "trained": trained["accuracy"],
            "steered": steered, "scale": scale, "fit_size": fit_size, "share": share}


def fitting_text(model, tok, rows: list[dict], system: str | None, max_new_tokens: int, batch: int) -> list[tuple]:
    """The trained model's own greedy completions of ``rows``: (ids, mask, prompt length) a batch, prompts
    left-padded, completions after them."""
    import torch

    from localrl.generation.rollout import encode_prompts, sample_groups, stop_token_ids

    stops, device = stop_token_ids(tok, model), next(model.parameters()).device
    chunks = []
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            r = sample_groups(model, encode_prompts(tok, rows[start:start + batch], system), 1, max_new_tokens, stops,
                              tok.pad_token_id, temperature=0.0)
            chunks.append((torch.cat([r.prompt_ids.to(device), r.completion_ids], 1),
                           torch.cat([r.prompt_mask.to(device), r.completion_mask], 1), r.prompt_ids.shape[1]))
    return chunks


def fit(model, tok, chunks: list[tuple], selector: str, share: float):
    """The vectors of ``selector`` on the fitting text (``fitting_text``)."""
    from localrl.policy.steering import SteeringVectors, boundary_ids, learned_tokens, token_effects

    if selector == "learned":
        effects = [token_effects(model, *chunk) for chunk in chunks]
        tokens = learned_tokens(sum(e[0] for e in effects), sum(e[1] for e in effects), share)
    else:
        tokens = boundary_ids(tok) if selector == "starts" else None
    fitted = [SteeringVectors.fit(model, *chunk, selector, tokens) for chunk in chunks]
    total = sum(f.positions for f in fitted)
    return SteeringVectors(sum(f.vectors * f.positions for f in fitted) / max(total, 1), selector, tokens, total)


def save_vectors(v, path: Path, metadata: dict) -> None:
    """The vectors, and the selector's tokens, as safetensors (written whole or not at all)."""
    from safetensors.torch import save

    from localrl.atomic import write_bytes_atomic

    tensors = {"vectors": v.vectors.contiguous()}
    if v.tokens is not None:
        tensors["tokens"] = v.tokens.contiguous()
    write_bytes_atomic(path, save(tensors, metadata={"selector": v.selector, **metadata}))
