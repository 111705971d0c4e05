"""trackio, Hugging Face's local-first tracker: the run goes into trackio's local store (``TRACKIO_DIR``,
by default under the Hugging Face cache) in the project ``TRACKIO_PROJECT`` (default ``localrl``) under the run
directory's name; ``trackio show --project localrl`` opens the dashboard. Warnings become trackio alerts.
Nothing is sent anywhere unless the user's own trackio settings say so."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Callable

from localrl.runs import Run
from localrl.trackers import Tracker, trackers

DEFAULT_PROJECT = "localrl"


@trackers.register("trackio")
class Trackio(Tracker):
    requires = "trackio"
    extra = "trackio"

    def __init__(self, run: Run, config: dict, first_step: int, log: Callable[[str], None]):
        import trackio

        self.trackio = trackio
        self.project = os.environ.get("TRACKIO_PROJECT") or DEFAULT_PROJECT
        self.name = run.path.name
        said = io.StringIO()
        with contextlib.redirect_stdout(said):  # its banner, in colour, would break the progress bar's line
            self.run = trackio.init(project=self.project, name=self.name, config=config, resume="allow",
                                    embed=False, auto_log_cpu=False, auto_log_gpu=False)
        log(f"report_to trackio: run {self.name} of project {self.project} in {trackio.utils.TRACKIO_DIR} "
            f"(trackio show --project {self.project})")

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        if tag == "warning":
            with contextlib.redirect_stdout(io.StringIO()):  # (the run's own log already says it)
                self.run.alert(f"step {step}", text, step=step)

    def image(self, tag: str, png: Path, step: int) -> None:
        self.run.log({tag: self.trackio.Image(str(png))}, step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.trackio.finish()  # (also forgets the run, which trackio would otherwise finish again at exit)
