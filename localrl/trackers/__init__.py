"""Experiment trackers: a run's records shown where a user already looks (``--report-to``, TRL's name).

The run's metrics file stays the run's record; a tracker is one more listener of the same
records, opened by the training loop on the main rank. A train record's fields are logged as
``train/<field>`` at its step and an eval record's (held-out, before and after) as ``eval/<field>``, the names
the metrics file has (a nested dict such as ``rewards`` as ``train/rewards/<name>``); warnings and notes as text;
the run's config at the start; and at the end, the learning curve (``localrl plot``'s PNG, kept in the run
directory too) as an image. Trackers are plug-ins registered by name, like objectives and samplers:

    from localrl.trackers import Tracker, trackers

    @trackers.register("mine")
    class Mine(Tracker):
        def scalars(self, values, step): ...

``report_to`` names any of them, comma-separated ("none": no tracker). Their packages are optional extras,
checked before the run starts.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Callable

from localrl.errors import UserError
from localrl.evaluation.plot import Curve
from localrl.registry import Registry
from localrl.runs import Run

trackers = Registry("tracker", "report_to", "localrl.trackers")


class Tracker:
    """One destination of a run's records. ``requires``: the modules it imports (comma-separated), found before the
    run starts (``extra``: the localrl extra that installs them)."""

    requires: str = ""
    extra: str = ""

    def __init__(self, run: Run, config: dict, first_step: int, log: Callable[[str], None]):
        """Open the run ``run`` (a resumed one continues after ``first_step``: what was logged past it is
        recomputed); ``config``: the run's settings, field by field."""

    def scalars(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def text(self, tag: str, text: str, step: int) -> None:
        """A warning or a note of the run (default: dropped)."""

    def image(self, tag: str, png: Path, step: int) -> None:
        """A picture of the run (default: dropped)."""

    def close(self) -> None:
        """Everything written where its reader finds it."""


def names(report_to: str) -> list[str]:
    """The trackers ``report_to`` names ("none" and empty: none)."""
    chosen = [n.strip() for n in report_to.split(",") if n.strip()]
    return [] if chosen in ([], ["none"]) else chosen


def check_report_to(report_to: str) -> None:
    """Each named tracker is known and its package installed: one line saying which extra to install."""
    chosen = names(report_to)
    if "none" in chosen:
        raise UserError("config field report_to: 'none' cannot be combined with a tracker", field="report_to")
    twice = sorted({n for n in chosen if chosen.count(n) > 1})
    if twice:
        raise UserError(f"config field report_to: {', '.join(twice)} named twice (each tracker gets the records "
                        f"once)", field="report_to")
    for name in chosen:
        plugin = trackers.get(name)
        for module in filter(None, getattr(plugin, "requires", "").split(",")):
            if importlib.util.find_spec(module.split(".")[0]) is None:
                raise UserError(f"config field report_to: {name} needs the {module.split('.')[0]} package, which is "
                                f"not installed: pip install 'localrl[{plugin.extra or name}]'", field="report_to")


def flatten(record: dict, prefix: str) -> dict[str, float]:
    """The numeric fields of a record as ``prefix/field`` (nested dicts as ``prefix/field/key``); booleans as 0/1;
    None, text and lists are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("kind", "step", "when"):
            continue
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}/{key}"))
        elif isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[f"{prefix}/{key}"] = float(value)
    return out


class Reporter:
    """The metrics listener that feeds the run's trackers; ``close`` adds the learning curve."""

    def __init__(self, opened: list[Tracker], run: Run, log: Callable[[str], None], curve: Curve = Curve()):
        self.trackers, self.run, self.log, self.curve = opened, run, log, curve
        self.last_step = 0

    @classmethod
    def open(cls, report_to: str, run: Run, config: dict, first_step: int, log: Callable[[str], None],
             curve: Curve = Curve()) -> "Reporter | None":
        """The trackers ``report_to`` names, opened on ``run`` (None: no tracker); ``curve``: what the learning curve
        drawn at the end shows."""
        chosen = names(report_to)
        if not chosen:
            return None
        opened: list[Tracker] = []
        try:
            for name in chosen:
                opened.append(trackers.get(name)(run, config, first_step, log))
        except BaseException:
            for tracker in opened:
                tracker.close()
            raise
        return cls(opened, run, log, curve)

    def __call__(self, record: dict) -> None:
        kind = record.get("kind")
        step = record.get("step")
        if not isinstance(step, int):
            return
        if kind in ("train", "eval"):
            self.last_step = max(self.last_step, step)
            values = flatten(record, kind)
            for tracker in self.trackers:
                tracker.scalars(values, step)
        elif kind in ("warning", "note"):
            for tracker in self.trackers:
                tracker.text(kind, record.get("message", ""), step)

    def close(self) -> None:
        """The learning curve drawn into the run directory and logged, then every tracker closed."""
        from localrl.evaluation.plot import plot_run

        try:
            if self.last_step:
                png = plot_run(self.run.path, self.run.learning_curve_path, curve=self.curve)
                for tracker in self.trackers:
                    tracker.image("learning_curve", png, self.last_step)
        except Exception as e:  # a failed drawing must not hide how the run ended
            self.log(f"report_to: the learning curve was not drawn ({type(e).__name__}: {e})")
        finally:
            for tracker in self.trackers:
                tracker.close()
