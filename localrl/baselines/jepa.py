"""A latent world model that plans: a JEPA encoder and predictor with a Gaussian prior on the latent,
a reward and a value head, and the cross-entropy method over short action sequences.

World model (JEPA, as LeWorldModel trains one end to end). An encoder maps an observation to a latent
``z``; an action-conditioned predictor maps ``(z, a)`` to the next latent, residually. The prediction
loss compares the predictor's latents, unrolled ``unroll`` steps from a replayed state, with the
encoder's latents of the states that followed. Nothing stops the gradient and there is no target
encoder: what keeps the encoder from the trivial answer (every state one latent, perfectly
predictable) is a Gaussian prior, SIGReg: along random one-dimensional projections, the batch's
latents are pulled towards a standard normal by the Epps-Pulley statistic (the squared distance of
their empirical characteristic function to the normal's, on a grid of frequencies).

The prior, two ways (the comparison Sub-JEPA makes):
- ``full`` (LeWorldModel): the projections are drawn afresh each update over the whole latent, so
  every direction of it is asked to be standard normal.
- ``subspace`` (Sub-JEPA): the latent is projected onto ``subspaces`` random orthogonal subspaces of
  ``subspace_dim`` dimensions each, drawn once and frozen; the projections are drawn within them, so
  only those subspaces are asked to be Gaussian (each on its own), and the rest of the latent may take
  the low-dimensional shape the dynamics have.

Heads on the latent: a reward head on the predictor's step, two logits: the point ends, and (if it does)
the agent won it (the expected reward is ``p_end (2 p_win - 1)``), trained on the predictor's own
unrolled latents, so that planning reads it where it will be used; a
value head ``V(z)`` trained by TD(0) on replayed transitions (semi-gradient, the bootstrap detached).
A point's end (SAME_STEP autoreset: the next observation is already the next serve) masks the
prediction loss from there and the value's bootstrap.

Planning (model-predictive control, for every environment at once): the cross-entropy method over
discrete action sequences of ``horizon`` steps. Each iteration samples ``population`` sequences from a
categorical distribution per step, rolls each out in the latent, scores it by the predicted rewards
(discounted, and weighted by the predicted chance that the point is still on) plus the discounted
value of the last latent, and refits the distributions to the ``elites`` best. The agent plays the
first ``replan_every`` actions of the best sequence seen, then plans again with the rest of it as one
candidate. While training, an epsilon-greedy choice on top explores (epsilon decaying from 1, as the
PC+Hebbian agent's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

PRIORS = ("subspace", "full")
ACTIVATIONS = {"elu": nn.ELU, "relu": nn.ReLU, "silu": nn.SiLU}


@dataclass
class JEPAConfig:
    prior: str = "subspace"  # "subspace" (Sub-JEPA) or "full" (LeWorldModel)
    latent: int = 16
    hidden: int = 64
    activation: str = "elu"  # ReLU and SiLU learned far less in 300k steps (docs/baselines.md)
    layers: int = 2  # hidden layers of the dynamics and the value
    subspaces: int = 2  # frozen random orthogonal subspaces the prior constrains ("subspace")
    subspace_dim: int = 4
    projections: int = 32  # random one-dimensional projections per evaluation of the prior
    prior_weight: float = 0.5
    unroll: int = 4  # steps the predictor is trained to roll out
    batch: int = 128  # replayed start states per update
    lr: float = 1e-3
    update_every: int = 4  # vector steps between updates
    warmup: int = 500  # vector steps of acting before the first update
    buffer: int = 50_000  # vector steps kept for replay
    gamma: float = 0.97
    horizon: int = 6
    replan_every: int = 2  # actions of a plan played before the next
    population: int = 16
    elites: int = 3
    iterations: int = 2
    epsilon_start: float = 1.0
    epsilon_end: float = 0.02
    explore_fraction: float = 0.2  # of the training steps over which epsilon decays

    def __post_init__(self):
        if self.prior not in PRIORS:
            raise ValueError(f"JEPAConfig.prior must be one of {', '.join(PRIORS)} (got {self.prior!r})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"JEPAConfig.activation must be one of {', '.join(ACTIVATIONS)} (got {self.activation!r})")
        if not 1 <= self.replan_every <= self.horizon:
            raise ValueError(f"JEPAConfig.replan_every must be 1 to the horizon, {self.horizon} "
                             f"(got {self.replan_every})")
        if self.prior == "subspace" and self.subspaces * self.subspace_dim > self.latent:
            raise ValueError(f"JEPAConfig: {self.subspaces} subspaces of {self.subspace_dim} dimensions do not fit a "
                             f"latent of {self.latent}")


def epps_pulley(projected: torch.Tensor, knots: int = 17, limit: float = 3.0) -> torch.Tensor:
    """Mean over columns of ``projected [batch, M]`` of the Epps-Pulley statistic against N(0, 1): the
    integral over frequencies t of ``|phi_emp(t) - exp(-t^2/2)|^2 exp(-t^2/2)`` (phi_emp the empirical
    characteristic function), by the trapezoid rule on [0, limit] (the integrand is even)."""
    t = torch.linspace(0.0, limit, knots, dtype=projected.dtype)
    angles = projected[..., None] * t  # [B, M, T]
    normal = torch.exp(-0.5 * t * t)
    error = (angles.cos().mean(0) - normal) ** 2 + angles.sin().mean(0) ** 2  # [M, T]
    return 2 * torch.trapezoid(error * normal, t, dim=-1).mean()


class GaussianPrior:
    """SIGReg over the whole latent (``full``) or over frozen random orthogonal subspaces (``subspace``)."""

    def __init__(self, cfg: JEPAConfig, generator: torch.Generator):
        self.cfg, self.generator = cfg, generator
        self.basis = None
        if cfg.prior == "subspace":
            q, _ = torch.linalg.qr(torch.randn(cfg.latent, cfg.latent, generator=generator))
            self.basis = q[:, :cfg.subspaces * cfg.subspace_dim].reshape(cfg.latent, cfg.subspaces, cfg.subspace_dim)

    def directions(self) -> torch.Tensor:
        """[latent, projections] unit directions, drawn afresh (within the frozen subspaces for ``subspace``)."""
        c = self.cfg
        if self.basis is None:
            d = torch.randn(c.latent, c.projections, generator=self.generator)
        else:
            which = torch.arange(c.projections) % c.subspaces  # every subspace gets its share
            inside = torch.randn(c.projections, c.subspace_dim, generator=self.generator)
            d = torch.einsum("lpm,pm->lp", self.basis[:, which], inside)
        return d / d.norm(dim=0, keepdim=True)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return epps_pulley(z @ self.directions())


def _mlp(n_in: int, hidden: int, n_out: int, layers: int = 1, activation: str = "elu") -> nn.Sequential:
    sizes = [n_in] + [hidden] * layers
    blocks = [m for a, b in zip(sizes, sizes[1:]) for m in (nn.Linear(a, b), ACTIVATIONS[activation]())]
    return nn.Sequential(*blocks, nn.Linear(sizes[-1], n_out))


class WorldModel(nn.Module):
    """Small on purpose: the planner calls the dynamics ``horizon x iterations`` times an environment step."""

    def __init__(self, n_obs: int, n_actions: int, cfg: JEPAConfig):
        super().__init__()
        self.n_actions, self.latent = n_actions, cfg.latent
        self.encoder = _mlp(n_obs, cfg.hidden, cfg.latent, 2, cfg.activation)
        # one network for the step: the change of the latent, and two logits: the point ends, and (if it
        # does) the agent won it
        self.dynamics = _mlp(cfg.latent + n_actions, cfg.hidden, cfg.latent + 2, cfg.layers, cfg.activation)
        self.value = _mlp(cfg.latent, cfg.hidden, 1, cfg.layers, cfg.activation)

    def step(self, z: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(next latent, [the point ends, the agent won it] logits) of taking ``actions`` in ``z``."""
        out = self.dynamics(torch.cat([z, nn.functional.one_hot(actions, self.n_actions).to(z.dtype)], -1))
        return z + out[..., :self.latent], out[..., self.latent:]


class Replay:
    """The last ``capacity`` vector steps: observations, actions, rewards, ends (a ring)."""

    def __init__(self, capacity: int, num_envs: int, n_obs: int):
        self.obs = np.zeros((capacity, num_envs, n_obs), np.float32)
        self.next_obs = np.zeros_like(self.obs)
        self.actions = np.zeros((capacity, num_envs), np.int64)
        self.rewards = np.zeros((capacity, num_envs), np.float32)
        self.dones = np.zeros((capacity, num_envs), np.float32)
        self.capacity, self.size, self.head = capacity, 0, 0

    def add(self, obs, actions, rewards, dones, next_obs) -> None:
        i = self.head
        self.obs[i], self.actions[i], self.rewards[i], self.dones[i], self.next_obs[i] = \
            obs, actions, rewards, dones, next_obs
        self.head, self.size = (i + 1) % self.capacity, min(self.size + 1, self.capacity)

    def sample(self, batch: int, length: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """``batch`` runs of ``length`` consecutive steps of one environment each."""
        oldest = (self.head - self.size) % self.capacity
        start = oldest + rng.integers(0, self.size - length + 1, batch)
        steps = (start[:, None] + np.arange(length)) % self.capacity  # [B, L]
        env = rng.integers(0, self.obs.shape[1], batch)[:, None]
        return {"obs": torch.from_numpy(self.obs[steps, env]), "next_obs": torch.from_numpy(self.next_obs[steps, env]),
                "actions": torch.from_numpy(self.actions[steps, env]),
                "rewards": torch.from_numpy(self.rewards[steps, env]),
                "dones": torch.from_numpy(self.dones[steps, env])}


class JEPAAgent:
    def __init__(self, n_obs: int, n_actions: int, num_envs: int, seed: int, total_steps: int,
                 cfg: JEPAConfig | None = None):
        self.cfg = c = cfg or JEPAConfig()
        torch.manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.model = WorldModel(n_obs, n_actions, c)
        self.prior = GaussianPrior(c, self.generator)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=c.lr, foreach=True)
        self.replay = Replay(min(c.buffer, max(total_steps, c.unroll + 1)), num_envs, n_obs)
        self.n_actions, self.total_steps, self.t = n_actions, total_steps, 0
        self.plans: torch.Tensor | None = None  # [envs, horizon] the sequences being played
        self.cursor = 0  # actions of them played so far

    # acting ---------------------------------------------------------------------------------------------

    def epsilon(self) -> float:
        c = self.cfg
        frac = min(1.0, self.t / max(1.0, c.explore_fraction * self.total_steps))
        return c.epsilon_start + frac * (c.epsilon_end - c.epsilon_start)

    @torch.no_grad()
    def score(self, z: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        """Predicted return of each action sequence: ``z [N, latent]``, ``sequences [N, P, H]`` -> [N, P].

        The dynamics network's layers are applied by hand (``WorldModel.step``, with the one-hot action's
        product taken as a row of the first weight): the planner's cost is in these calls."""
        n, p, h = sequences.shape
        first, activation, *middle, last = self.model.dynamics  # the first layer by hand, the rest as they are
        latent = self.model.latent
        w_z, w_a = first.weight[:, :latent].t().contiguous(), first.weight[:, latent:].t().contiguous()
        w_out = last.weight.t().contiguous()
        z = z[:, None].expand(n, p, -1).reshape(n * p, -1)
        flat = sequences.reshape(n * p, h)
        total = torch.zeros(n * p)
        weight = torch.ones(n * p)  # the discount times the predicted chance that the point is still on
        for step, action in enumerate(flat.t()):
            hidden = activation(torch.addmm(first.bias, z, w_z).add_(w_a.index_select(0, action)))
            for layer in middle:
                hidden = layer(hidden)
            out = torch.addmm(last.bias, hidden, w_out)
            z = z + out[:, :latent]
            ends, wins = out[:, latent:].sigmoid().unbind(-1)
            ended = weight * ends
            total.addcmul_(ended, wins.mul(2).sub_(1))
            weight = (weight - ended).mul_(self.cfg.gamma)
        total.addcmul_(weight, self.model.value(z).squeeze(-1))
        return total.view(n, p)

    @torch.no_grad()
    def plan(self, obs: np.ndarray, warm: torch.Tensor | None = None) -> torch.Tensor:
        """The cross-entropy method over action sequences, for every environment at once: the best
        sequence found for each, [N, horizon]. ``warm``: a candidate sequence per environment."""
        c = self.cfg
        z = self.model.encoder(torch.as_tensor(obs))
        n = len(obs)
        probs = torch.full((n * c.horizon, self.n_actions), 1.0 / self.n_actions)
        best, best_score = None, None
        for it in range(c.iterations):
            draws = torch.multinomial(probs, c.population, replacement=True, generator=self.generator)
            sequences = draws.view(n, c.horizon, c.population).transpose(1, 2).contiguous()  # [N, P, H]
            if it == 0 and warm is not None:
                sequences[:, 0] = warm
            scores = self.score(z, sequences)
            top = scores.topk(c.elites, dim=1)
            elites = sequences.gather(1, top.indices[..., None].expand(-1, -1, c.horizon))  # [N, E, H]
            counts = nn.functional.one_hot(elites, self.n_actions).float().mean(1)  # [N, H, A]
            probs = (0.9 * counts + 0.1 / self.n_actions).view(n * c.horizon, -1)
            if best is None:
                best, best_score = elites[:, 0], top.values[:, 0]
            else:
                better = top.values[:, 0] > best_score
                best = torch.where(better[:, None], elites[:, 0], best)
                best_score = torch.maximum(best_score, top.values[:, 0])
        return best

    def controller(self, obs: np.ndarray) -> np.ndarray:
        """Model-predictive control: plan, play the plan's first ``replan_every`` actions, plan again (from
        the rest of the last plan as a candidate)."""
        c, n = self.cfg, len(obs)
        if self.plans is None or len(self.plans) != n:
            self.plans, self.cursor = self.plan(obs), 0
        elif self.cursor == c.replan_every:
            rest = self.plans[:, self.cursor:]
            warm = torch.cat([rest, rest[:, -1:].expand(-1, c.horizon - rest.shape[1])], 1)
            self.plans, self.cursor = self.plan(obs, warm), 0
        self.cursor += 1
        return self.plans[:, self.cursor - 1].numpy()

    def act(self, obs: np.ndarray, greedy: bool = False) -> np.ndarray:
        if not greedy and self.epsilon() >= 1.0:
            return self.rng.integers(0, self.n_actions, len(obs))
        actions = self.controller(obs)
        if greedy:
            return actions
        explore = self.rng.random(len(obs)) < self.epsilon()
        return np.where(explore, self.rng.integers(0, self.n_actions, len(obs)), actions)

    # learning -------------------------------------------------------------------------------------------

    def observe(self, obs, actions, rewards, dones, next_obs) -> None:
        self.replay.add(obs, actions, rewards, dones, next_obs)
        self.t += 1
        c = self.cfg
        if self.t >= c.warmup and self.t % c.update_every == 0 and self.replay.size > c.unroll:
            self.update()

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The world model's losses on replayed runs of ``unroll`` steps: prediction, prior, reward, value."""
        m = self.model
        obs, next_obs, actions = batch["obs"], batch["next_obs"], batch["actions"]
        rewards, dones = batch["rewards"], batch["dones"]
        b, k = actions.shape
        z_all = m.encoder(torch.cat([obs, next_obs[:, -1:]], 1))  # [B, K+1, latent]: states 0..K
        # a step is still in the start's point if no earlier step of the run ended one
        live = torch.cat([torch.ones(b, 1), torch.cumprod(1 - dones, 1)[:, :-1]], 1)  # [B, K]
        z, prediction, reward = z_all[:, 0], 0.0, 0.0
        for step in range(k):
            z, logits = m.step(z, actions[:, step])
            target = z_all[:, step + 1]
            moved = live[:, step] * (1 - dones[:, step])  # the next state is this point's (not a new serve)
            prediction = prediction + (moved * (z - target).pow(2).mean(-1)).sum() / moved.sum().clamp(min=1)
            scored = (rewards[:, step] != 0).float()
            ends = nn.functional.binary_cross_entropy_with_logits(logits[:, 0], scored, reduction="none")
            wins = nn.functional.binary_cross_entropy_with_logits(logits[:, 1], (rewards[:, step] > 0).float(),
                                                                  reduction="none")
            reward = reward + (live[:, step] * ends).sum() / live[:, step].sum().clamp(min=1) \
                + (live[:, step] * scored * wins).sum() / (live[:, step] * scored).sum().clamp(min=1)
        with torch.no_grad():  # obs[:, 1] is next_obs[:, 0]: the same latent, the bootstrap detached
            target = rewards[:, 0] + self.cfg.gamma * (1 - dones[:, 0]) * m.value(z_all[:, 1]).squeeze(-1)
        value = (m.value(z_all[:, 0]).squeeze(-1) - target).pow(2).mean()
        return {"prediction": prediction / k, "prior": self.prior(z_all[:, 0]),
                "reward": reward / k, "value": value}

    def update(self) -> dict[str, float]:
        c = self.cfg
        parts = self.losses(self.replay.sample(c.batch, c.unroll, self.rng))
        loss = parts["prediction"] + c.prior_weight * parts["prior"] + parts["reward"] + parts["value"]
        self.opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), 10.0)
        self.opt.step()
        return {name: float(v.detach()) for name, v in parts.items()}

    @torch.no_grad()
    def effective_rank(self, obs: np.ndarray) -> float:
        """exp of the entropy of the latent's normalised singular values over ``obs`` (Roy and Vetterli)."""
        z = self.model.encoder(torch.as_tensor(obs))
        s = torch.linalg.svdvals(z - z.mean(0))
        p = s / s.sum()
        return float(torch.exp(-(p * p.clamp(min=1e-12).log()).sum()))
