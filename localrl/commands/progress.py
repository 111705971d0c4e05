"""The terminal's view of a run: a rich progress display fed by metrics records (loading, held-out
evaluations, steps with the objective's one-line summary and an ETA)."""

from __future__ import annotations

from localrl.metrics import eta_seconds, format_duration


class ProgressBar:
    """A rich progress display fed by metrics records: what the run is loading, the held-out
    evaluation's progress, then steps with reward, accuracy, KL and an ETA."""

    def __init__(self, total: int, summary=None, eval_line=None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), eta_column(), transient=False)
        self.console = self.progress.console
        self.total = total
        self.tasks: dict[str, int] = {}
        self.steps: list[dict] = []  # the train records seen, for the ETA
        self.summary = summary  # a step record in one line (the objective's); None: no train records expected
        self.eval_line = eval_line  # an evaluation record in one line (the sampler's); None: none expected

    def log(self, text: str) -> None:
        """A line above the bar, as written: not rich markup ("pip install 'localrl[llama]'" keeps its brackets)."""
        self.console.print(text, markup=False, highlight=False)

    def _task(self, key: str, description: str, total: int, completed: int = 0) -> int:
        if key not in self.tasks:
            self.tasks[key] = self.progress.add_task(description, total=total, completed=completed, stats="",
                                                     eta=None)
            if not self.progress.live.is_started:
                self.progress.start()
        return self.tasks[key]

    def __call__(self, record: dict) -> None:
        kind = record.get("kind")
        if kind == "status":
            if "total" not in record:
                self.log(record["message"])
            elif record["total"]:
                label = record.get("label") or f"eval {record.get('when')}"
                task = self._task(label, label, record["total"])
                self.progress.update(task, completed=record["done"])
        elif kind == "eval" and self.eval_line is not None:
            self.log(f"eval {record['when']}: {self.eval_line(record)}")
        elif kind == "train":  # the clock starts at the first step, after loading and evaluation
            task = self._task("train", "train", self.total, record["step"] - 1)
            stats = self.summary(record) if self.summary is not None else ""
            self.steps.append(record)
            self.progress.update(task, completed=record["step"], stats=stats, eta=eta_seconds(self.steps, self.total))

    def close(self) -> None:
        if self.progress.live.is_started:
            self.progress.stop()


def eta_column():
    """The time left: a training bar's from the run's measured step times (``metrics.eta_seconds``: steps of
    minutes get an ETA too), any other bar's from rich's recent speed."""
    from rich.progress import ProgressColumn, TimeRemainingColumn
    from rich.text import Text

    class EtaColumn(ProgressColumn):
        fallback = TimeRemainingColumn()

        def render(self, task):
            if task.fields.get("eta") is None:
                return self.fallback.render(task)
            return Text(format_duration(task.fields["eta"]), style="progress.remaining")

    return EtaColumn()
