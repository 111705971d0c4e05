"""TensorBoard: event files in the run directory's ``tensorboard/`` folder (``tensorboard --logdir runs``
shows every run), written through torch's SummaryWriter. Flushed after every step, so a live run is current."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from localrl.runs import Run
from localrl.trackers import Tracker, trackers


@trackers.register("tensorboard")
class TensorBoard(Tracker):
    requires = "tensorboard"
    extra = "tensorboard"

    def __init__(self, run: Run, config: dict, first_step: int, log: Callable[[str], None]):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run.tensorboard_dir
        # on resume, what was logged after the checkpoint is recomputed: TensorBoard drops it at first_step + 1
        self.writer = SummaryWriter(str(self.path), purge_step=first_step + 1 if first_step else None)
        if not first_step:
            rows = "\n".join(f"| {k} | `{v!r}` |" for k, v in config.items())
            self.writer.add_text("config", "| field | value |\n| --- | --- |\n" + rows, 0)
        log(f"report_to tensorboard: {self.path} (tensorboard --logdir {self.path.parent.parent})")

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)
        self.writer.flush()

    def image(self, tag: str, png: Path, step: int) -> None:
        from matplotlib.image import imread

        pixels = (imread(png)[..., :3] * 255).round().astype("uint8")  # RGBA floats in [0, 1] -> RGB bytes
        self.writer.add_image(tag, pixels, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
