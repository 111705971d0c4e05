"""A backprop-free agent: a predictive-coding encoder and a distributional TD readout, in numpy.

Nothing here uses autograd (the module does not import torch); every update is local.

Encoder (sparse predictive coding). Latent causes ``x >= 0`` (H of them) predict the
observation through a generative matrix: ``o_hat = W x + b``. The energy is the squared
prediction error plus a sparsity prior,

    F(x) = 1/2 ||o - W x - b||^2 + lam * sum(x).

Inference is real and iterative: with the observation clamped, the latents relax for T steps
down the energy gradient, ``x <- max(0, x + eta (W^T e - lam))`` with ``e = o - W x - b``
(each latent sees only the errors it predicts). The step ``eta = 1 / ||W||^2`` keeps every
step from raising the energy. Learning is Hebbian: ``dW = lr_w e x^T`` (error times
presynaptic activity), after which each latent's outgoing weights are rescaled to unit norm
(a per-neuron operation), as in sparse coding.

Readout (distributional TD, Dabney et al. 2020). For each action, N value channels read the
features ``phi = [x / gain, 1]`` linearly (``gain``: each latent's running RMS, floored).
Channel i learns with rates in the ratio ``tau_i : 1 - tau_i`` on positive and negative TD
errors, so it converges to the tau_i-expectile of its target. Deliberate deviation: every
channel bootstraps from the mean of the next state's channels, so the channels are the
expectiles of the one-step target ``r + gamma mean_j Q_j(s', a')``, not of the whole return;
bootstrapping each channel from itself diverged with these linear features. Learning is
SARSA(lambda) with accumulating eligibility traces (shared by the channels). Actions:
epsilon-greedy on the mean over channels, epsilon decaying from 1.

Ablations: ``n_channels=1`` (scalar TD), ``learn_encoder=False`` (a frozen random encoder:
inference still runs, the generative weights never change; the bias still tracks the mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PCConfig:
    latents: int = 128
    inference_steps: int = 20
    sparsity: float = 0.05  # lam
    encoder_lr: float = 0.005
    bias_lr: float = 0.2  # the prediction bias tracks the input mean, fast
    learn_encoder: bool = True  # False: the generative weights stay random (the bias still learns)
    n_channels: int = 8
    lr: float = 0.5  # alpha, divided by the squared feature norm and the trace length
    gamma: float = 0.99
    trace_decay: float = 0.9  # lambda
    epsilon_start: float = 1.0  # all random at first: a greedy start walks the paddle into a wall and stays
    epsilon_end: float = 0.02
    explore_fraction: float = 0.5  # of the training steps over which epsilon decays


class PCEncoder:
    def __init__(self, n_in: int, n_latent: int, rng: np.random.Generator, sparsity: float = 0.05,
                 steps: int = 20, lr: float = 0.005, bias_lr: float = 0.2):
        self.W = rng.normal(size=(n_in, n_latent))
        self.W /= np.linalg.norm(self.W, axis=0, keepdims=True)
        self.b = np.zeros(n_in)
        self.sparsity, self.steps, self.lr, self.bias_lr = sparsity, steps, lr, bias_lr
        self._set_step()

    def _set_step(self) -> None:
        self.eta = 1.0 / np.linalg.eigvalsh(self.W @ self.W.T)[-1]  # 1 / ||W||^2

    def energy(self, o: np.ndarray, x: np.ndarray) -> np.ndarray:
        e = o - x @ self.W.T - self.b
        return 0.5 * (e * e).sum(-1) + self.sparsity * x.sum(-1)

    def infer(self, o: np.ndarray, trace: list | None = None) -> np.ndarray:
        """Relax the latents of a batch of observations [B, n_in] -> [B, n_latent]."""
        x = np.zeros((o.shape[0], self.W.shape[1]))
        for _ in range(self.steps):
            e = o - x @ self.W.T - self.b
            x = np.maximum(0.0, x + self.eta * (e @ self.W - self.sparsity))
            if trace is not None:
                trace.append(self.energy(o, x))
        return x

    def learn(self, o: np.ndarray, x: np.ndarray, weights: bool = True) -> None:
        """Hebbian step: prediction error times presynaptic activity, then unit-norm latents; the
        bias (presynaptic activity 1) learns at its own, faster rate. ``weights=False``: bias only."""
        e = o - x @ self.W.T - self.b  # [B, n_in]
        self.b += self.bias_lr * e.mean(0)
        if weights:
            self.W += self.lr * e.T @ x / len(o)
            self.W /= np.maximum(np.linalg.norm(self.W, axis=0, keepdims=True), 1e-8)
            self._set_step()


class DistributionalTD:
    """N expectile channels per action, linear in the features, SARSA(lambda) with traces."""

    def __init__(self, n_features: int, n_actions: int, n_channels: int, num_envs: int, lr: float,
                 gamma: float, trace_decay: float):
        self.taus = (np.arange(n_channels) + 0.5) / n_channels  # [N]
        self.w = np.zeros((n_actions, n_channels, n_features))
        self.z = np.zeros((num_envs, n_actions, n_features))  # eligibility traces
        self.lr, self.gamma, self.trace_decay = lr, gamma, trace_decay

    def values(self, phi: np.ndarray) -> np.ndarray:
        return np.einsum("ef,anf->ean", phi, self.w)  # [E, A, N]

    def update(self, phi, actions, rewards, dones, phi_next, actions_next) -> np.ndarray:
        """One TD step for every env; returns the TD errors [E, N]."""
        e = np.arange(len(actions))
        q = self.values(phi)[e, actions]  # [E, N]
        # every channel bootstraps from the mean of the next values: bootstrapping each from its
        # own next value diverged here (the high expectiles feed on their own optimism)
        q_next = self.values(phi_next)[e, actions_next].mean(-1, keepdims=True)  # [E, 1]
        delta = rewards[:, None] + self.gamma * (1.0 - dones[:, None]) * q_next - q
        self.z *= self.gamma * self.trace_decay
        self.z[e, actions] += phi
        # normalised by the features' squared norm times the trace's effective length
        scale = float((phi * phi).sum(-1).mean()) / (1 - self.gamma * self.trace_decay)
        # tau on positive errors, 1 - tau on negative ones, scaled so neither exceeds lr (the
        # ratio, which fixes the expectile, is unchanged; extreme channels stay stable)
        up, down = self.taus, 1 - self.taus
        rate = self.lr * np.where(delta > 0, up, down) / np.maximum(up, down) / max(scale, 1e-8)
        self.w += np.einsum("en,eaf->anf", rate * delta, self.z) / len(actions)
        self.z[dones.astype(bool)] = 0.0
        return delta


class PCHebbianAgent:
    def __init__(self, n_obs: int, n_actions: int, num_envs: int, seed: int, total_steps: int,
                 cfg: PCConfig | None = None, name: str = "PC+Hebbian"):
        self.cfg = c = cfg or PCConfig()
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.encoder = PCEncoder(n_obs, c.latents, self.rng, c.sparsity, c.inference_steps, c.encoder_lr, c.bias_lr)
        self.td = DistributionalTD(c.latents + 1, n_actions, c.n_channels, num_envs, c.lr, c.gamma, c.trace_decay)
        self.n_actions = n_actions
        self.gain_ms = np.full(c.latents, 1e-2)  # running mean square of each latent
        self.total_steps, self.t = total_steps, 0  # vector steps, for the epsilon schedule
        self._current = self._next = None  # (obs, features, latents, actions) of this step and the next

    def features(self, obs: np.ndarray, adapt: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(readout features, latents). Each latent is divided by its own running RMS (a per-neuron
        gain, homeostasis), floored at a quarter of the mean so rarely active latents cannot spike."""
        x = self.encoder.infer(obs.astype(np.float64))
        if adapt:
            self.gain_ms = 0.999 * self.gain_ms + 0.001 * (x * x).mean(0)
        gain = np.sqrt(np.maximum(self.gain_ms, 0.25 * self.gain_ms.mean()) + 1e-8)
        return np.concatenate([x / gain, np.ones((len(x), 1))], 1), x

    def epsilon(self) -> float:
        c = self.cfg
        frac = min(1.0, self.t / max(1.0, c.explore_fraction * self.total_steps))
        return c.epsilon_start + frac * (c.epsilon_end - c.epsilon_start)

    def _choose(self, phi: np.ndarray, epsilon: float) -> np.ndarray:
        greedy = self.td.values(phi).mean(-1).argmax(-1)
        explore = self.rng.random(len(phi)) < epsilon
        return np.where(explore, self.rng.integers(0, self.n_actions, len(phi)), greedy)

    def act(self, obs: np.ndarray, greedy: bool = False) -> np.ndarray:
        if greedy:
            return self._choose(self.features(obs)[0], 0.0)
        if self._next is not None and self._next[0] is obs:  # chosen already, for the SARSA update
            self._current = self._next
        else:
            phi, x = self.features(obs)
            self._current = (obs, phi, x, self._choose(phi, self.epsilon()))
        return self._current[3]

    def observe(self, obs, actions, rewards, dones, next_obs) -> None:
        """One local update of the encoder and the readout. SARSA bootstraps from the action the
        agent will take next, so that action is chosen here and reused by the next ``act``."""
        _, phi, x, _ = self._current
        self.encoder.learn(obs.astype(np.float64), x, weights=self.cfg.learn_encoder)
        phi_next, x_next = self.features(next_obs, adapt=True)
        next_actions = self._choose(phi_next, self.epsilon())
        self.td.update(phi, actions, rewards.astype(np.float64), dones.astype(np.float64), phi_next, next_actions)
        self._next = (next_obs, phi_next, x_next, next_actions)
        self.t += 1
