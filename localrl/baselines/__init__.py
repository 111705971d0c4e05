"""Backprop-free RL baselines next to PPO, on a vectorised numpy Pong."""
