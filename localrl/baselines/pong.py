"""A vectorised Pong in numpy with the gymnasium vector API: one point is one episode.

The agent's paddle is on the left (x = 0), a scripted opponent's on the right (x = 1); the
field is the unit square. Observation (6 floats, all agents see exactly these): ball x, ball
y, ball x-velocity and y-velocity (scaled to about [-1, 1]), the agent's paddle y, the
opponent's paddle y. Actions: 0 stay, 1 up, 2 down. Reward +1 when the opponent misses, -1
when the agent does; the point ends there and the game is served again in the same step
(``AutoresetMode.SAME_STEP``: the returned observation is the new point's first).

Physics: the ball bounces off the top and bottom walls; a paddle returns it when the ball's
y is within half a paddle of the paddle's centre, and where it hits changes the ball's
y-velocity ("english"), so a player can aim. Each return speeds the ball up a little.

The opponent tracks where the ball was ``reaction_delay`` steps ago, moving at ``skill``
times the agent's paddle speed, and only while the ball comes towards it. Everything random
(serves) comes from one seeded generator: the same seed and actions give the same game.
"""

from __future__ import annotations

import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

STAY, UP, DOWN = 0, 1, 2
PADDLE_HALF = 0.1
# Speeds per step: a point lasts some 50 steps, so a single action matters enough for
# value-based learners to tell actions apart (Atari agents get the same from frame skipping).
PADDLE_SPEED = 0.12
BALL_SPEED = 0.09  # |vx| at the serve
MAX_VX, MAX_VY = 0.18, 0.15
VEL_SCALE = 1 / MAX_VY  # observed velocities in about [-1, 1]
MAX_STEPS_PER_POINT = 3000


class VectorPong(VectorEnv):
    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int = 16, opponent_skill: float = 0.8, reaction_delay: int = 1, seed: int = 0):
        self.num_envs = num_envs
        self.skill, self.delay = opponent_skill, reaction_delay
        self.single_observation_space = spaces.Box(-1.5, 1.5, (6,), np.float32)
        self.single_action_space = spaces.Discrete(3)
        self.observation_space = spaces.Box(-1.5, 1.5, (num_envs, 6), np.float32)
        self.action_space = spaces.MultiDiscrete([3] * num_envs)
        self._seed = seed
        self.reset(seed=seed)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.rng = np.random.default_rng(self._seed if seed is None else seed)
        n = self.num_envs
        self.ball = np.zeros((n, 2))  # x, y
        self.vel = np.zeros((n, 2))
        self.paddle = np.full(n, 0.5)
        self.opponent = np.full(n, 0.5)
        self.history = np.full((self.delay + 1, n), 0.5)  # past ball y, for the opponent's delay
        self.steps = np.zeros(n, dtype=np.int64)
        self._serve(np.ones(n, dtype=bool))
        return self._obs(), {}

    def _serve(self, which: np.ndarray) -> None:
        k = int(which.sum())
        if k == 0:
            return
        self.ball[which] = np.stack([np.full(k, 0.5), self.rng.uniform(0.2, 0.8, k)], 1)
        direction = np.where(self.rng.random(k) < 0.5, -1.0, 1.0)
        self.vel[which] = np.stack([direction * BALL_SPEED, self.rng.uniform(-0.02, 0.02, k)], 1)
        self.history[:, which] = self.ball[which, 1]
        self.steps[which] = 0

    def _obs(self) -> np.ndarray:
        return np.concatenate([self.ball, self.vel * VEL_SCALE, self.paddle[:, None], self.opponent[:, None]],
                              1).astype(np.float32)

    def step(self, actions):
        a = np.asarray(actions)
        self.paddle = np.clip(self.paddle + PADDLE_SPEED * ((a == UP).astype(float) - (a == DOWN)),
                              PADDLE_HALF, 1 - PADDLE_HALF)
        # the opponent chases where the ball was `delay` steps ago, while it comes its way
        target = self.history[0]
        coming = self.vel[:, 0] > 0
        move = np.clip(target - self.opponent, -self.skill * PADDLE_SPEED, self.skill * PADDLE_SPEED)
        self.opponent = np.clip(self.opponent + np.where(coming, move, 0.0), PADDLE_HALF, 1 - PADDLE_HALF)

        self.ball += self.vel
        for wall in (0.0, 1.0):  # reflect off the top and bottom
            out = (self.ball[:, 1] - wall) * (1 if wall else -1) > 0
            self.ball[out, 1] = 2 * wall - self.ball[out, 1]
            self.vel[out, 1] *= -1
        reward = np.zeros(self.num_envs, dtype=np.float32)
        for side, paddle, sign in ((0.0, self.paddle, 1.0), (1.0, self.opponent, -1.0)):
            crossing = (self.ball[:, 0] - side) * sign <= 0
            offset = (self.ball[:, 1] - paddle) / PADDLE_HALF
            hit = crossing & (np.abs(offset) <= 1)
            self.ball[hit, 0] = 2 * side - self.ball[hit, 0]
            self.vel[hit, 0] = np.clip(-self.vel[hit, 0] * 1.05, -MAX_VX, MAX_VX)
            self.vel[hit, 1] = np.clip(self.vel[hit, 1] + 0.03 * offset[hit], -MAX_VY, MAX_VY)
            reward[crossing & ~hit] = -sign  # the left miss costs the agent a point; the right wins one
        self.history = np.roll(self.history, -1, 0)
        self.history[-1] = self.ball[:, 1]
        self.steps += 1
        terminated = reward != 0
        truncated = ~terminated & (self.steps >= MAX_STEPS_PER_POINT)
        self._serve(terminated | truncated)
        return self._obs(), reward, terminated, truncated, {}


def tracker_policy(obs: np.ndarray) -> np.ndarray:
    """The scripted reference: move the paddle towards the ball's height."""
    gap = obs[:, 1] - obs[:, 4]
    return np.where(gap > PADDLE_SPEED / 2, UP, np.where(gap < -PADDLE_SPEED / 2, DOWN, STAY))
