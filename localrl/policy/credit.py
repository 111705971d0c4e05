"""Turn-level credit for multi-turn episodes: each turn's tokens get an advantage of their own, from the rewards the
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
"""

from __future__ import annotations

import torch


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
