"""PPO (clipped surrogate, GAE, one MLP trunk per head), the gradient-based reference.

Deliberate simplifications: a categorical policy over the 3 actions and a value head, each
a 2-layer tanh MLP; advantages normalised per minibatch; no observation normalisation (the
observations are already scaled to about [-1, 1]); a fixed learning rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass
class PPOConfig:
    hidden: int = 64
    lr: float = 2.5e-3
    rollout: int = 64  # steps per env between updates
    epochs: int = 4
    minibatches: int = 4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    entropy: float = 0.01
    value_coef: float = 0.5
    max_grad_norm: float = 0.5


def _mlp(n_in: int, hidden: int, n_out: int, out_gain: float) -> nn.Sequential:
    layers = [nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, n_out)]
    for layer in layers[::2]:
        nn.init.orthogonal_(layer.weight, np.sqrt(2))
        nn.init.zeros_(layer.bias)
    nn.init.orthogonal_(layers[-1].weight, out_gain)
    return nn.Sequential(*layers)


class PPOAgent:
    name = "PPO"

    def __init__(self, n_obs: int, n_actions: int, num_envs: int, seed: int, cfg: PPOConfig | None = None):
        self.cfg = cfg or PPOConfig()
        torch.manual_seed(seed)
        self.policy = _mlp(n_obs, self.cfg.hidden, n_actions, 0.01)
        self.value = _mlp(n_obs, self.cfg.hidden, 1, 1.0)
        params = [*self.policy.parameters(), *self.value.parameters()]
        self.opt = torch.optim.Adam(params, lr=self.cfg.lr, eps=1e-5)
        self.generator = torch.Generator().manual_seed(seed)
        self.buffer: list[tuple] = []
        self.num_envs = num_envs

    @torch.no_grad()
    def act(self, obs: np.ndarray, greedy: bool = False) -> np.ndarray:
        logits = self.policy(torch.as_tensor(obs))
        if greedy:
            return logits.argmax(-1).numpy()
        self._last = (obs, logits)
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=self.generator).squeeze(-1).numpy()

    def observe(self, obs, actions, rewards, dones, next_obs) -> None:
        """Record one vector step; update after ``rollout`` of them."""
        _, logits = self._last
        logp = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(actions)[:, None]).squeeze(-1)
        self.buffer.append((obs, actions, rewards, dones, logp))
        if len(self.buffer) == self.cfg.rollout:
            self._update(next_obs)
            self.buffer = []

    def _update(self, next_obs: np.ndarray) -> None:
        c = self.cfg
        obs = torch.as_tensor(np.stack([b[0] for b in self.buffer]))  # [T, N, obs]
        actions = torch.as_tensor(np.stack([b[1] for b in self.buffer]))  # [T, N]
        rewards = torch.as_tensor(np.stack([b[2] for b in self.buffer]), dtype=torch.float32)
        dones = torch.as_tensor(np.stack([b[3] for b in self.buffer]), dtype=torch.float32)
        old_logp = torch.stack([b[4] for b in self.buffer])
        with torch.no_grad():
            values = self.value(obs).squeeze(-1)  # [T, N]
            next_value = self.value(torch.as_tensor(next_obs)).squeeze(-1)
            adv = torch.zeros_like(rewards)
            last = torch.zeros_like(next_value)
            for t in reversed(range(len(self.buffer))):
                nxt = next_value if t == len(self.buffer) - 1 else values[t + 1]
                delta = rewards[t] + c.gamma * nxt * (1 - dones[t]) - values[t]
                last = delta + c.gamma * c.gae_lambda * (1 - dones[t]) * last
                adv[t] = last
            returns = adv + values
        flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
        obs, actions, old_logp, adv, returns = map(flat, (obs, actions, old_logp, adv, returns))
        n = obs.shape[0]
        for _ in range(c.epochs):
            order = torch.randperm(n, generator=self.generator)
            for idx in order.chunk(c.minibatches):
                logits = self.policy(obs[idx])
                logp_all = torch.log_softmax(logits, -1)
                logp = logp_all.gather(-1, actions[idx][:, None]).squeeze(-1)
                ratio = torch.exp(logp - old_logp[idx])
                a = adv[idx]
                a = (a - a.mean()) / (a.std() + 1e-8)
                policy_loss = -torch.min(ratio * a, ratio.clamp(1 - c.clip, 1 + c.clip) * a).mean()
                value_loss = 0.5 * (self.value(obs[idx]).squeeze(-1) - returns[idx]).pow(2).mean()
                entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
                loss = policy_loss + c.value_coef * value_loss - c.entropy * entropy
                self.opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_([*self.policy.parameters(), *self.value.parameters()], c.max_grad_norm)
                self.opt.step()
