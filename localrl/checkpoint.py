"""Atomic checkpoints of a run: the PEFT adapter, optimizer, RNG and step state.

A checkpoint is written into a hidden temporary directory beside the others and renamed
into place as ``checkpoints/step-NNNNNN`` only when complete, so an interrupted write never
leaves something resume could mistake for a checkpoint. Each checkpoint directory is a
regular PEFT adapter (``PeftModel.from_pretrained(base, ckpt_dir)`` loads it).
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from localrl.atomic import atomic_dir
from localrl.errors import UserError

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: Path, step: int, model, optimizer, keep: int = 2) -> Path:
    """Write checkpoint ``step`` (number of completed steps) atomically; keep the newest ``keep``."""
    final = run_dir / "checkpoints" / f"step-{step:06d}"
    with atomic_dir(final, fsync=True) as tmp:
        model.save_pretrained(str(tmp))
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": _rng_state()}, tmp / STATE_FILE)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Delete temporary directories left by checkpoint writes that were killed midway."""
    for stale in (Path(run_dir) / "checkpoints").glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_checkpoint(ckpt: Path, model, optimizer) -> int:
    """Restore adapter weights, optimizer and RNG state from ``ckpt``; returns its step."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        weights = load_file(str(ckpt / "adapter_model.safetensors"))
        state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
        result = set_peft_model_state_dict(model, weights)
        if result.unexpected_keys:
            raise ValueError(f"unexpected adapter keys {result.unexpected_keys[:3]}")
        optimizer.load_state_dict(state["optimizer"])
    except Exception as e:  # a damaged file must stop resume with one line, not a traceback
        raise UserError(f"checkpoint {ckpt}: cannot be loaded ({str(e).splitlines()[0]})") from None
    _set_rng_state(state["rng"])
    return int(state["step"])
