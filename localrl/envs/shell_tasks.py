"""Shell tasks: generated from a seed, each with the files it starts from, an instruction, a
verifier of the final file tree and/or answer, and an expert's commands that solve it.

Families (what a terminal agent is asked to do) and levels (how much one command must do):

=======  ============================  ==============================  ==================================
family   level 1                       level 2                         level 3
=======  ============================  ==============================  ==================================
count    lines in a file (wc)          lines matching a word (grep)    files of a type, any depth (find)
files    create a file or directory    rename or delete one file       move every file of a type (mv)
edit     write a word into a file      append a line                   replace a word everywhere (sed)
csv      data rows in a CSV            sum of a column (awk)           sorted distinct values (cut|sort)
multi    copy a file, then answer      count matches into a file       extract matches, then delete
=======  ============================  ==============================  ==================================

Scores are honest: a question is right or wrong (1 or 0); a file task scores the fraction of
its conditions that hold, and the files it must not touch count as conditions too (so
``rm *`` does not earn the credit of "delete the .tmp files"). The held-out split is by task
content (a hash), so no held-out task is ever a training task, whatever seeds drew them.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import stat
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from localrl.data.rewards import exact_match, numeric_match
from localrl.envs.task_names import EXTS, Names, Placeholders
from localrl.envs.workdir_reads import lstat_inside, read_inside
from localrl.errors import UserError, failure_line

FAMILIES = ("count", "files", "edit", "csv", "multi")
LEVELS = (1, 2, 3)
HELD_OUT_ONE_IN = 10
VERIFIER_TIMEOUT = 10.0  # seconds a user's verifier may take for one episode

LOG_LEVELS = ("INFO", "INFO", "INFO", "WARN", "ERROR", "DEBUG")
PEOPLE = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "kim", "leo", "mia",
          "nina", "omar", "paul", "rosa", "sam", "tina", "uma", "victor", "wendy")
CITIES = ("paris", "lima", "oslo", "rome", "tokyo", "cairo", "delhi", "quito", "seoul", "berlin")

def _say(rng: random.Random, *wordings: str) -> str:
    """One of several wordings of the same instruction (the first is the one the README quotes)."""
    return rng.choice(wordings)


@dataclass(frozen=True)
class Check:
    """What must hold at the end of an episode. Each field is one or more conditions."""

    answer: str | None = None  # the final answer (numbers compared as numbers, text ignoring case and spacing)
    files: Mapping[str, str] = field(default_factory=dict)  # path -> content (a final newline is ignored)
    absent: tuple[str, ...] = ()  # paths that must not exist
    dirs: tuple[str, ...] = ()  # directories that must exist

    def score(self, root: Path, final_text: str) -> float:
        met = []
        if self.answer is not None:
            match = numeric_match if _is_number(self.answer) else exact_match
            met.append(match([final_text], [self.answer])[0] == 1.0)
        for path, content in self.files.items():
            met.append(read_inside(root, path) == content.rstrip("\n"))
        met += [lstat_inside(root, path) is None for path in self.absent]
        met += [(st := lstat_inside(root, path)) is not None and stat.S_ISDIR(st.st_mode) for path in self.dirs]
        return sum(met) / len(met) if met else 0.0

    def to_json(self) -> dict:
        return {k: v for k, v in (("answer", self.answer), ("files", dict(self.files)), ("absent", list(self.absent)),
                                  ("dirs", list(self.dirs))) if v}


@dataclass(frozen=True)
class ShellTask:
    instruction: str
    files: Mapping[str, str]  # the working directory at the start: path -> content ("dir/" for an empty directory)
    check: Check | Callable[[Path, str], float]  # a Check, or a user's callable (workdir, final text) -> [0, 1]
    family: str = "user"
    level: int = 0
    solution: tuple[str, ...] = ()  # an expert's commands, in order (generated tasks)
    slip: tuple[str, ...] = ()  # a careless agent's commands instead: plausible, not (wholly) right

    def setup(self, root: Path) -> None:
        for path, content in self.files.items():
            target = root / path
            if path.endswith("/"):
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(content)

    def score(self, root: Path, final_text: str, timeout: float = VERIFIER_TIMEOUT) -> float:
        """The episode's score in [0, 1]. A built-in Check cannot hang (it follows no link and reads
        only regular files); a user's callable runs under ``timeout``: past it the episode scores 0
        with a warning on stderr, and the step goes on. A callable that raises or returns something
        that is not a finite number stops the run with one line naming the task."""
        if isinstance(self.check, Check):
            return self.check.score(root, final_text)
        finished, value, error = call_with_timeout(self.check, (root, final_text), timeout)
        if not finished:
            print(f"localrl: warning: the verifier of task {self.instruction[:40]!r} ran past {timeout:g} s; "
                  f"the episode scores 0", file=sys.stderr)
            return 0.0
        if error is not None:
            raise UserError(f"the verifier of task {self.instruction[:40]!r} failed: {failure_line(error)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"the verifier of task {self.instruction[:40]!r} returned {value!r}: "
                            f"it must return a finite number in [0, 1]")
        return min(1.0, max(0.0, float(value)))

    def key(self) -> str:
        """A digest of what the agent sees: the instruction and the starting files."""
        blob = json.dumps([self.instruction, sorted(self.files.items())]).encode()
        return hashlib.sha256(blob).hexdigest()

    def is_held_out(self) -> bool:
        return int(self.key()[:8], 16) % HELD_OUT_ONE_IN == 0


def call_with_timeout(fn: Callable, args: tuple, seconds: float) -> tuple[bool, object, Exception | None]:
    """``fn(*args)`` in a daemon thread: (finished, its value, the exception it raised). A user's function
    that does not return is left to the process's exit: Python cannot stop a thread."""
    out: dict = {}

    def call() -> None:
        try:
            out["value"] = fn(*args)
        except Exception as e:  # noqa: BLE001 - the user's function: the caller reports it in one line
            out["error"] = e

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    return not worker.is_alive(), out.get("value"), out.get("error")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _lines(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _log(names: Names, n: int) -> list[str]:
    rng = names.rng
    return [f"12:{rng.randrange(60):02d}:{rng.randrange(60):02d} {rng.choice(LOG_LEVELS)} {rng.choice(PEOPLE)} "
            f"{names.word()}" for _ in range(n)]


def _csv(rng: random.Random, n: int) -> tuple[list[str], list[tuple[str, str, int]]]:
    rows = [(rng.choice(PEOPLE), rng.choice(CITIES), rng.randint(1, 99)) for _ in range(n)]
    return ["name,city,amount"] + [f"{a},{b},{c}" for a, b, c in rows], rows


# -- the families: each returns (instruction, files, check, solution, slip) -------------------------
# A slip is what a careless agent types instead: plausible, and wrong (or only partly right). The
# built-in agent model learns from trajectories that slip often, so that RL has something to fix.

def _count(names: Names, level: int):
    rng = names.rng
    if level == 1:
        f, lines = names.file("txt"), names.words(rng.randint(2, 9))
        return (_say(rng, f"How many lines are in {f}?", f"How many lines does {f} have?", f"Count the lines in {f}."),
                {f: _lines(lines)}, Check(answer=str(len(lines))), (f"wc -l < {f}",), (f"wc -w < {f}",))
    if level == 2:
        f, lines, level_word = names.file("log"), _log(names, rng.randint(4, 10)), rng.choice(("ERROR", "WARN", "INFO"))
        n = sum(level_word in line for line in lines)
        return (_say(rng, f"How many lines of {f} contain {level_word}?", f"How many {level_word} lines are in {f}?",
                     f"Count the lines in {f} that contain {level_word}."),
                {f: _lines(lines)}, Check(answer=str(n)),
                (f"grep -c {level_word} {f}",), (f"grep -c {level_word.lower()} {f}",))
    ext = rng.choice(EXTS)
    files = {}
    for _ in range(rng.randint(2, 7)):
        path = "/".join([names.word() for _ in range(rng.randint(0, 2))] + [names.file()])
        if not any(p.startswith(path + "/") or path.startswith(p + "/") for p in files):
            files[path] = names.word() + "\n"
    n = sum(p.endswith("." + ext) for p in files)
    return (_say(rng, f"How many .{ext} files are there in this directory and its subdirectories?",
                 f"Count the .{ext} files here, subdirectories included."), files,
            Check(answer=str(n)), (f"find . -type f -name '*.{ext}' | wc -l",), (f"ls *.{ext} | wc -l",))


def _files(names: Names, level: int):
    rng = names.rng
    others = {name: names.word() + "\n" for name in names.distinct_files(rng.randint(1, 3))}
    if level == 1:
        if rng.random() < 0.5:
            d = names.word()
            return (_say(rng, f"Create a directory named {d}.", f"Make a new directory called {d}."), others,
                    Check(files=others, dirs=(d,)), (f"mkdir {d}",), (f"touch {d}",))
        f = next(n for n in iter(names.file, None) if n not in others)
        return (_say(rng, f"Create an empty file named {f}.", f"Make an empty file called {f}."), others,
                Check(files={**others, f: ""}), (f"touch {f}",), (f"mkdir {f}",))
    src = next(iter(others))
    rest = {k: v for k, v in others.items() if k != src}
    if level == 2:
        if rng.random() < 0.5:
            dst = next(n for n in iter(names.file, None) if n not in others)
            return (_say(rng, f"Rename {src} to {dst}.", f"Change the name of {src} to {dst}."), others,
                    Check(files={**rest, dst: others[src]}, absent=(src,)), (f"mv {src} {dst}",), (f"cp {src} {dst}",))
        return (_say(rng, f"Delete the file {src}.", f"Remove {src}."), others, Check(files=rest, absent=(src,)),
                (f"rm {src}",), (f"truncate -s 0 {src}",))
    ext = rng.choice(EXTS)
    d = next(n for n in iter(names.word, None) if not any(k.startswith(n + ".") for k in others))
    moving = {name: names.word() + "\n" for name in names.distinct_files(rng.randint(1, 4), ext)}
    rest = {k: v for k, v in others.items() if not k.endswith("." + ext)}
    files = {**rest, **moving}
    moved = {f"{d}/{k}": v for k, v in moving.items()}
    return (_say(rng, f"Move every .{ext} file into a new directory named {d}.",
                 f"Put all the .{ext} files into a new directory called {d}."), files,
            Check(files={**rest, **moved}, absent=tuple(moving), dirs=(d,)), (f"mkdir {d}", f"mv *.{ext} {d}/"),
            (f"mv *.{ext} {d}",))


def _edit(names: Names, level: int):
    rng = names.rng
    f = names.file("txt")
    if level == 1:
        word = names.word()
        return (_say(rng, f"Write the word {word} into a file named {f}.", f"Create {f} containing the word {word}."),
                {}, Check(files={f: word}), (f"echo {word} > {f}",), (f"echo {f} > {word}",))
    lines = names.words(rng.randint(1, 5))
    if level == 2:
        word = names.word()
        return (_say(rng, f"Append the line {word} to {f}.", f"Add a line {word} at the end of {f}."),
                {f: _lines(lines)}, Check(files={f: _lines(lines + [word])}), (f"echo {word} >> {f}",),
                (f"echo {word} > {f}",))
    old = rng.choice(" ".join(lines).split())
    new = next(w for w in iter(names.word, None) if w != old)
    replaced = [" ".join(new if w == old else w for w in line.split()) for line in lines]
    return (_say(rng, f"Replace every {old} with {new} in {f}.", f"In {f}, change every {old} to {new}."),
            {f: _lines(lines)}, Check(files={f: _lines(replaced)}),
            (f"sed -i 's/\\b{old}\\b/{new}/g' {f}",), (f"sed 's/{old}/{new}/g' {f}",))


def _csv_task(names: Names, level: int):
    rng = names.rng
    f = names.file("csv")
    text, rows = _csv(rng, rng.randint(2, 8))
    files = {f: _lines(text)}
    if level == 1:
        return (_say(rng, f"How many data rows (not counting the header) does {f} have?",
                     f"Count the rows of {f}, not counting its header."), files, Check(answer=str(len(rows))),
                (f"tail -n +2 {f} | wc -l",), (f"wc -l < {f}",))
    if level == 2:
        return (_say(rng, f"What is the sum of the amount column in {f}?", f"Add up the amount column of {f}."),
                files, Check(answer=str(sum(r[2] for r in rows))),
                (f"awk -F, 'NR > 1 {{ s += $3 }} END {{ print s }}' {f}",),
                (f"awk -F, 'NR > 1 {{ s += $2 }} END {{ print s + 0 }}' {f}",))
    col, k = rng.choice((("name", 1), ("city", 2)))
    out = f"{col}s.txt"
    values = sorted({r[k - 1] for r in rows})
    return (f"Write the distinct values of the {col} column of {f} into {out}, sorted, one per line.", files,
            Check(files={**files, out: _lines(values)}), (f"tail -n +2 {f} | cut -d, -f{k} | sort -u > {out}",),
            (f"cut -d, -f{k} {f} | sort -u > {out}",))


def _multi(names: Names, level: int):
    rng = names.rng
    f, lines = names.file("log"), _log(names, rng.randint(4, 9))
    files = {f: _lines(lines)}
    if level == 1:
        d = names.word()
        return (f"Copy {f} into a new directory named {d}, then say how many lines it has.", files,
                Check(answer=str(len(lines)), files={**files, f"{d}/{f}": _lines(lines)}),
                (f"mkdir {d}", f"cp {f} {d}/", f"wc -l < {d}/{f}"), (f"wc -l < {f}",))
    word = rng.choice(("ERROR", "WARN", "INFO"))
    matching = [line for line in lines if word in line]
    out = names.file("txt")
    if level == 2:
        return (f"Count the lines of {f} that contain {word} and write the number into {out}.", files,
                Check(files={**files, out: str(len(matching))}), (f"grep -c {word} {f} > {out}",),
                (f"grep {word} {f} > {out}",))
    return (f"Copy every line of {f} that contains {word} into {out}, then delete {f}.", files,
            Check(files={out: _lines(matching)}, absent=(f,)), (f"grep {word} {f} > {out}", f"rm {f}"),
            (f"grep {word} {f} > {out}",))


_FAMILY = {"count": _count, "files": _files, "edit": _edit, "csv": _csv_task, "multi": _multi}


def generate(seed: int, family: str | None = None, level: int | None = None, names: str = "seen") -> ShellTask:
    """The task drawn by ``seed`` (a family and level drawn too unless given), its names from one side of the
    vocabulary (``names``: seen or unseen) or ``placeholders`` (``Placeholders``)."""
    rng = random.Random(f"shell-task-{seed}")
    family = family or rng.choice(FAMILIES)
    level = level or rng.choice(LEVELS)
    drawn = Placeholders(rng) if names == "placeholders" else Names(rng, names)
    instruction, files, check, solution, slip = _FAMILY[family](drawn, level)
    return ShellTask(instruction, files, check, family, level, solution, slip)


def sample_tasks(rng: random.Random, n: int, held_out: bool = False, families: tuple[str, ...] = FAMILIES,
                 levels: tuple[int, ...] = LEVELS, names: str | None = None) -> list[ShellTask]:
    """``n`` tasks from one side of the split, drawn by ``rng``: training tasks name only seen names,
    held-out ones only unseen names (unless ``names`` says otherwise)."""
    tasks: list[ShellTask] = []
    names = names or ("unseen" if held_out else "seen")
    while len(tasks) < n:
        task = generate(rng.randrange(2**62), rng.choice(families), rng.choice(levels), names)
        if task.is_held_out() == held_out:
            tasks.append(task)
    return tasks


def held_out_tasks(n: int, families: tuple[str, ...] = FAMILIES, levels: tuple[int, ...] = LEVELS,
                   names: str = "unseen") -> list[ShellTask]:
    """The fixed held-out set: the same ``n`` tasks for every run, spread evenly over families and levels, naming
    files the model never saw in training (``names="seen"``: held-out tasks with training names, to compare)."""
    cells = [(f, lv) for f in families for lv in levels]
    tasks, seed = [], 0
    while len(tasks) < n:
        family, level = cells[len(tasks) % len(cells)]
        task = generate(10**9 + seed, family, level, names)
        seed += 1
        if task.is_held_out():
            tasks.append(task)
    return tasks
