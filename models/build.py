"""Every built-in model's pretraining, by name: ``localrl models build NAME`` runs it."""

from __future__ import annotations

from pathlib import Path

from localrl.models.pretraining import Pretraining, arith_data, pretrain
from localrl.models.shell_pretraining import ShellPretraining, shell_data

PRETRAINING: dict[str, Pretraining] = {
    "tiny-arith": Pretraining(),
    "tiny-arith-conf": Pretraining(confidence=True),
    "tiny-arith-verbose": Pretraining(restate=0.5),
    "tiny-shell": ShellPretraining(steps=5000, batch_size=32, max_positions=512, corpus_tasks=6000),
}


def build(out_dir: str | Path, spec: Pretraining, log=print) -> Path:
    """Pretrain ``spec`` into ``out_dir`` (atomically)."""
    return pretrain(out_dir, spec, shell_data if isinstance(spec, ShellPretraining) else arith_data, log)
