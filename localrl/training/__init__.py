"""The training loop and what it runs beside every step: the loop itself (``loop.train``: run directory,
resume, evaluations, checkpoints, signals, the distributed world), the per-step token schedule, the reward
and length monitors, and the C heap's release of freed memory. It names no objective, sampler or environment;
those plug in through ``localrl.objectives``, ``localrl.samplers`` and ``localrl.envs``."""
