"""``localrl bench agent-step``: one multi-turn GRPO step on the shell environment, timed by part."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch


def bench_agent_step(model: str = "tiny-shell", prompts: int = 4, group: int = 8, max_turns: int = 4,
                     max_new_tokens: int = 48, repeats: int = 3, log=print) -> dict:
    """One multi-turn GRPO step of ``model`` on the shell environment, timed by part: the rollout's model
    decoding against its environment steps (sandboxed commands), then the update of those same episodes
    with the shared-prompt forward against the concatenated one (median of ``repeats`` each, alternated,
    gradients checked equal). The optimizer never steps, so every repeat sees the same weights."""
    from localrl.envs import environment_for, task_seeds
    from localrl.generation.agent_rollout import run_episodes
    from localrl.generation.rollout import stop_token_ids
    from localrl.modeling import load_policy
    from localrl.policy.grpo import policy_update
    from localrl.policy.losses import group_advantages
    from localrl.training.settings import build_config

    cfg = build_config(None, {"env": "shell", "model": model, "prompts_per_step": prompts, "group_size": group,
                              "max_turns": max_turns, "max_new_tokens": max_new_tokens, "quantize": "none",
                              "device": "cpu", "eval_size": 0})
    setup = environment_for(cfg)
    torch.manual_seed(0)
    policy, tok = load_policy(cfg, torch.device("cpu"))
    context = getattr(policy.config, "max_position_embeddings", None) or 2048
    policy.eval()
    out = run_episodes(policy, tok, setup.make_env, task_seeds(cfg, 0), group, max_new_tokens,
                       stop_token_ids(tok, policy), 1.0, torch.Generator().manual_seed(0), context, cfg.env_workers,
                       setup.system)
    s = out.stats
    rollout = out.rollout
    advantages = group_advantages(torch.tensor(out.rewards, dtype=torch.float64), group).float()
    if advantages.eq(0).all():  # every group scored alike: give the update something to compute, all of one sign
        advantages = torch.linspace(0.5, 1.5, advantages.numel())  # (a group's episodes can be identical: +-1 cancels)
    log(f"rollout: {prompts} tasks x {group} episodes, {s['turns']:.1f} turns and {s['model_tokens']:.0f} model "
        f"tokens per episode, trajectories of up to {rollout.completion_ids.size(1)} tokens after a "
        f"{rollout.prompt_ids.size(1)}-token prompt; {setup.describe}")
    log(f"  model decoding {s['model_s']:7.2f} s   environment {s['env_s']:7.2f} s (commands in the sandbox "
        f"{s['sandbox_s']:.2f} s of work, {cfg.env_workers} at once)   whole rollout {s['rollout_s']:.2f} s")

    class NoStep:
        def zero_grad(self, set_to_none=True):
            policy.zero_grad(set_to_none=True)

        def step(self):
            pass

    times = {True: [], False: []}
    grads = {}
    policy.train()
    for _ in range(repeats):
        for cache in (True, False):
            step_cfg = dataclasses.replace(cfg, prompt_cache=cache, beta=0.0, max_grad_norm=0.0)
            t0 = time.perf_counter()
            policy_update(policy, NoStep(), rollout, advantages, step_cfg)
            times[cache].append(time.perf_counter() - t0)
            grads[cache] = [p.grad.clone() for p in policy.parameters() if p.grad is not None]
    # relative to the largest gradient entry of all: a fresh adapter's lora_A gradients are 0 (B is 0), and float
    # noise of 1e-10 in one path against an exact 0 in the other is no difference worth a per-tensor ratio
    scale = max(b.abs().max().item() for b in grads[False])
    err = max((a - b).abs().max().item() for a, b in zip(grads[True], grads[False])) / max(scale, 1e-12)
    shared, concat = statistics.median(times[True]), statistics.median(times[False])
    log(f"update: shared-prompt forward {shared:.3f} s, concatenated {concat:.3f} s: {concat / shared:.2f}x "
        f"(largest relative gradient difference {err:.1e})")
    return {"model_s": s["model_s"], "env_s": s["env_s"], "sandbox_s": s["sandbox_s"], "rollout_s": s["rollout_s"],
            "update_shared_s": shared, "update_concat_s": concat, "speedup": concat / shared, "grad_rel_err": err,
            "turns": s["turns"], **setup.details}
