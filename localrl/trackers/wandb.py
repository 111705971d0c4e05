"""Weights & Biases, offline: the run is written to the run directory's ``wandb/`` folder and nothing is sent
anywhere (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later), unless the user's own ``WANDB_MODE`` says
otherwise. The W&B run's id is made from the run directory, so a resumed run continues the same W&B run (a new
offline folder with that id, which ``wandb sync`` adds to it; the steps after the checkpoint, computed again, are
logged again). Project ``WANDB_PROJECT`` (default ``localrl``), name the run directory's; warnings become W&B alerts,
the learning curve an image."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from localrl.runs import Run
from localrl.trackers import Tracker, trackers

DEFAULT_PROJECT = "localrl"


def run_id(run: Run) -> str:
    """The W&B run id of a run directory: its name and a digest of its absolute path (W&B ids are at most 64 of
    ``[A-Za-z0-9_-]``)."""
    digest = hashlib.sha256(str(run.path.resolve()).encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in run.path.name)[:48]
    return f"{name}-{digest}"


@trackers.register("wandb")
class WandB(Tracker):
    requires = "wandb"
    extra = "wandb"

    def __init__(self, run: Run, config: dict, first_step: int, log: Callable[[str], None]):
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # (its crash reports go to a server)
        import wandb

        self.wandb = wandb
        mode = os.environ.get("WANDB_MODE") or "offline"
        self.path = run.wandb_dir  # (W&B writes into DIR/wandb)
        self.path.mkdir(exist_ok=True)
        settings = wandb.Settings(mode=mode, console="off", silent=True, x_disable_stats=True, x_disable_meta=True,
                                  disable_git=True, save_code=False)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, name=run.path.name,
                              id=run_id(run), dir=str(run.path), resume="allow", config=config, settings=settings)
        where = f"{self.path} (wandb sync {self.path}/offline-run-*)" if mode == "offline" else self.run.url
        log(f"report_to wandb: run {self.run.id}, {mode}, in {where}")

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        if tag == "warning":
            self.run.alert(title=f"step {step}", text=text, level=self.wandb.AlertLevel.WARN)

    def image(self, tag: str, png: Path, step: int) -> None:
        self.run.log({tag: self.wandb.Image(str(png))}, step=step)

    def close(self) -> None:
        self.run.finish()
