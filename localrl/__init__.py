"""localrl: local-first reinforcement learning for small reasoning models.

The Python API: ``from localrl import TrainConfig, train`` (``train(TrainConfig(steps=10))``), loaded on first
use so that ``import localrl`` stays light."""

_API = {"train": "localrl.training.loop", "resume_config": "localrl.training.loop", "TrainConfig": "localrl.training.settings",
        "build_config": "localrl.training.settings"}


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'localrl' has no attribute {name!r}")
