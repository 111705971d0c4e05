"""Environments for multi-turn rollouts.

An environment is one episode at a time, in the shape TRL's ``environment_factory``, verl's
agent loop and SkyRL's ``BaseTextEnv`` users know:

    observation = env.reset(seed)           # the task, as the first user message
    observation, done = env.step(action)    # the model's whole turn in, the tool's output back
    score = env.reward()                    # [0, 1], from a verifier of the final state
    env.close()                             # remove what the episode made

``reset(seed)`` makes the episode reproducible: the same seed gives the same task and the same
starting state. The rollout loop (``localrl/agent_rollout.py``) owns the chat template, the
token masks and the model; an environment sees and returns text only.
"""

from __future__ import annotations

from typing import Protocol


class Environment(Protocol):
    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> tuple[str, bool]: ...

    def reward(self) -> float: ...

    def close(self) -> None: ...
