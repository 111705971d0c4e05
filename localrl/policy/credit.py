"""Credit beyond one group-relative number per completion: turns of an episode, and prefixes of a tree.

Turn-level credit for multi-turn episodes: each turn's tokens get an advantage of their own, from the rewards the
environment gave after each turn (a process reward: the shell's share of its verifier's checks met so far), instead
of the whole episode's one group-relative number.

For episode i of a group and its turn k (of K_i turns), the turn rewards r_ik are the environment's, with the
remainder of the episode's final reward R_i added to its last turn (so the rewards of an episode add up to R_i; an
environment without turn rewards gives 0 for every turn but the last, which gets R_i). The return from turn k is
G_ik = sum_{j >= k} gamma^(j - k) r_ij (``turn_discount``), and the advantage of turn k is G_ik normalised among the
group's episodes that have a turn k (their mean subtracted, divided by their standard deviation; 0 where fewer than
two have one, or all alike): episodes are compared turn index by turn index, GiGPO's step-level grouping where the
k-th turns of a group's episodes share their starting point (at k = 0 they all do: the task's prompt). With
gamma 1 the first turn's advantage is the episode-level GRPO advantage; with gamma 0 each turn is credited with
what it achieved itself. Every token of a turn gets the turn's advantage; the environment's tokens get none.

Prefix trees (Tree-OPO's staged advantages, Huang, Nguyen and Zimmer 2025, arXiv:2509.09284): a prompt's
completions start from prefixes of a teacher's solution at different depths, and a completion from a deep prefix
succeeds more easily than one from the bare prompt, so one group mean is the wrong baseline for both. Each
completion's reward has its prefix's value subtracted, V(p) estimated from p's subtree (the completions of p and of
every deeper prefix of the same trace): ``expectation`` their mean reward, ``optimistic`` their best, ``pessimistic``
their worst (the paper's three heuristics); those differences are then normalised over the whole tree as GRPO
normalises a group (the tree's mean subtracted, divided by its standard deviation per ``scale_rewards``).
"""

from __future__ import annotations

import torch

from localrl.policy.losses import group_advantages

TREE_BASELINES = ("expectation", "optimistic", "pessimistic")


def turn_returns(turn_rewards: list[float], turns: int, final: float, gamma: float) -> list[float]:
    """The discounted return from each of an episode's ``turns`` turns (the remainder of ``final`` on the last)."""
    rewards = (list(turn_rewards) + [0.0] * turns)[:turns]
    if turns:
        rewards[-1] += final - sum(rewards)
    out, running = [0.0] * turns, 0.0
    for k in reversed(range(turns)):
        running = rewards[k] + gamma * running
        out[k] = running
    return out


def turn_advantages(spans: list[list[tuple[int, int]]], turn_rewards: list[list[float]], finals: list[float],
                    group_size: int, width: int, gamma: float) -> torch.Tensor:
    """[N, width] per-token advantages of N episodes (groups of ``group_size`` in order): each turn's normalised
    return on its tokens (``spans``: each episode's turns as [start, end) in its completion), 0 elsewhere."""
    n = len(spans)
    out = torch.zeros(n, width, dtype=torch.float32)
    returns = [turn_returns(turn_rewards[i], len(spans[i]), finals[i], gamma) for i in range(n)]
    for g in range(0, n, group_size):
        members = range(g, min(g + group_size, n))
        for k in range(max((len(spans[i]) for i in members), default=0)):
            have = [i for i in members if k < len(spans[i])]
            values = torch.tensor([returns[i][k] for i in have], dtype=torch.float64)
            if len(have) < 2 or values.std() == 0:
                continue
            normalised = (values - values.mean()) / values.std()
            for i, a in zip(have, normalised.tolist()):
                start, end = spans[i][k]
                out[i, start:min(end, width)] = a
    return out


def tree_advantages(rewards: torch.Tensor, depths: torch.Tensor, group_size: int, baseline: str = "expectation",
                    scale: str = "group") -> torch.Tensor:
    """[T*K*G] advantages of T trees' completions (tree-major, then prefix, then sibling) from their ``rewards``;
    ``depths`` [T, K]: how deep each of a tree's K prefixes is (steps of the trace; deeper prefixes extend shallower
    ones), each completed ``group_size`` times. A prefix's subtree is every prefix of its tree at least as deep."""
    trees, k = depths.shape
    r = rewards.double().view(trees, k, group_size)
    below = depths[:, None, :] >= depths[:, :, None]  # [T, K, K']: prefix K' is in the subtree of prefix K
    if baseline == "expectation":
        sums = (below.double() * r.sum(-1)[:, None, :]).sum(-1)
        value = sums / (below.sum(-1) * group_size)
    elif baseline in ("optimistic", "pessimistic"):
        best = baseline == "optimistic"
        ends = r.amax(-1) if best else r.amin(-1)  # [T, K]
        fill = -torch.inf if best else torch.inf
        spread = torch.where(below, ends[:, None, :], torch.full_like(ends[:, None, :], fill))
        value = spread.amax(-1) if best else spread.amin(-1)
    else:
        raise ValueError(f"unknown tree baseline {baseline!r}; use {', '.join(TREE_BASELINES)}")
    staged = (r - value[..., None]).reshape(-1)
    return group_advantages(staged, k * group_size, scale)
