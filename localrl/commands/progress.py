"""The terminal's view of a run: a rich progress display fed by metrics records (loading, held-out
evaluations, steps with the objective's one-line summary and an ETA)."""

from __future__ import annotations

from localrl.metrics import eta_seconds, format_duration


class ProgressBar:
    """A rich progress display fed by metrics records: what the run is loading, the held-out
    evaluation's progress, then steps with reward, accuracy, KL and an ETA."""

    def __init__(self, total: int, summary=None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), eta_column(), transient=False)
        self.console = self.progress.console
        self.total = total
        self.tasks: dict[str, int] = {}
        self.steps: list[dict] = []  # the train records seen, for the ETA
        self.summary = summary  # a step record in one line (the objective's); None: no train records expected

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
        elif kind == "eval":
            self.log(f"eval {record['when']}: {eval_line(record)}")
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


def eval_line(r: dict) -> str:
    if "attack_success" in r:  # a two-policy game (samplers/self_play.py)
        lo, hi = r["interval"]
        control = f", control questions right {r['game_control']:.1%}" if "game_control" in r else ""
        return (f"defended {r['accuracy']:.1%} [95% CI {lo:.1%}, {hi:.1%}], attacks succeeded "
                f"{r['attack_success']:.1%}{control} ({r['n']} held-out attacks of {r['held_out_set']}, greedy)")
    if "families" in r:  # episodes in an environment
        lo, hi = r["interval"]
        return (f"success {r['accuracy']:.1%} [95% CI {lo:.1%}, {hi:.1%}], mean reward {r['reward_mean']:.3f}, "
                f"{r['turns']:.1f} turns, {r.get('tool_calls', 0):.2f} tool calls and {r['invalid_calls']:.2f} "
                f"invalid calls per episode ({r['n']} held-out tasks, greedy)")
    if "logp_accuracy" in r:  # preference pairs (samplers/preferences.py)
        return (f"preference accuracy {r['accuracy']:.1%} (implicit reward; a tie counts half), mean margin "
                f"{r['reward_mean']:.3f}, the policy's own log-probability prefers the chosen in "
                f"{r['logp_accuracy']:.1%} ({r['n']} held-out pairs)")
    line = f"accuracy {r['accuracy']:.1%}, mean reward {r['reward_mean']:.3f} ({r['n']} held-out, greedy)"
    if "ece" in r:
        line += (f"; calibration: ECE {r['ece']:.3f}, Brier {r['brier']:.3f}, mean confidence "
                 f"{r['confidence_mean']:.2f} ({r['confidence_stated']:.0%} stated one)")
    return line
