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
import os
import random
import re
import stat
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from localrl.data.jsonl import json_objects
from localrl.data.rewards import exact_match, numeric_match
from localrl.errors import UserError, failure_line, user_callable

FAMILIES = ("count", "files", "edit", "csv", "multi")
LEVELS = (1, 2, 3)
HELD_OUT_ONE_IN = 10
VERIFIER_TIMEOUT = 10.0  # seconds a user's verifier may take for one episode

LOG_LEVELS = ("INFO", "INFO", "INFO", "WARN", "ERROR", "DEBUG")
PEOPLE = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "kim", "leo", "mia",
          "nina", "omar", "paul", "rosa", "sam", "tina", "uma", "victor", "wendy")
CITIES = ("paris", "lima", "oslo", "rome", "tokyo", "cairo", "delhi", "quito", "seoul", "berlin")
EXTS = ("txt", "log", "csv", "md", "tmp", "json")

# -- names -----------------------------------------------------------------------------------------------
# File, directory and word names come from a large vocabulary (words people name files with, and made-up
# pronounceable names), so an agent must read each name from its task rather than recall it. The vocabulary
# is split in two: training tasks use only ``seen`` names, and the held-out evaluation uses only ``unseen``
# ones, so its figure is for names the model never met. The README's examples (EXAMPLE_NAMES) are unseen.

COMMON_NAMES = ("notes", "report", "data", "config", "main", "readme", "todo", "users", "events", "output", "input",
                "debug", "backup", "archive", "summary", "results", "orders", "sales", "people", "visits", "apple",
                "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "ocean", "amber", "cedar", "delta",
                "ember", "frost", "grape", "honey", "ivory", "koala", "lunar", "mango", "olive", "pearl", "raven",
                "solar", "tulip", "willow", "zebra", "draft", "index", "cache", "queue", "batch", "daily", "weekly",
                "monthly", "budget", "invoice", "ledger", "metrics", "trace", "error", "alpha", "beta", "gamma",
                "kernel", "client", "worker", "proxy", "router", "mail", "web", "api", "db", "docs", "src", "lib",
                "logs", "tmp", "old", "new", "final", "temp", "test", "demo", "sample", "local", "remote", "site")
EXAMPLE_NAMES = ("app", "server", "access", "system", "build", "deploy", "audit", "backend", "cron", "nginx")
SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
NAME_SIDES = ("seen", "unseen")


def name_side(name: str) -> str:
    """Which side of the vocabulary a name is on: a quarter of names by hash, and every example name, are unseen."""
    if name in EXAMPLE_NAMES or int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 4 == 0:
        return "unseen"
    return "seen"


class Names:
    """Names from one side of the vocabulary, drawn by ``rng``."""

    def __init__(self, rng: random.Random, side: str = "seen"):
        self.rng, self.side = rng, side

    def word(self) -> str:
        while True:
            if self.rng.random() < 0.4:
                name = self.rng.choice(COMMON_NAMES + EXAMPLE_NAMES)
                if self.rng.random() < 0.4:  # a known word cut short or run on (`appl`, `notesa`): copy, never complete
                    name = (name[:self.rng.randint(2, len(name) - 1)] if self.rng.random() < 0.5 and len(name) > 3
                            else name + self.rng.choice(SYLLABLES))
            else:
                name = "".join(self.rng.choice(SYLLABLES) for _ in range(self.rng.randint(2, 3)))
            if name_side(name) == self.side:
                return name

    def file(self, ext: str | None = None) -> str:
        """``word.ext``, sometimes with a number (``notes_2.txt``, ``app-14.log``)."""
        stem = self.word()
        if self.rng.random() < 0.15:
            stem += f"{self.rng.choice('_-')}{self.rng.randint(1, 99)}"
        return f"{stem}.{ext or self.rng.choice(EXTS)}"

    def distinct_files(self, k: int, ext: str | None = None) -> list[str]:
        names: list[str] = []
        while len(names) < k:
            if (name := self.file(ext)) not in names:
                names.append(name)
        return names

    def words(self, n: int) -> list[str]:
        return [" ".join(self.word() for _ in range(self.rng.randint(1, 3))) for _ in range(n)]


class Placeholders(Names):
    """Stand-ins for every name a task draws (``zq0zq``, ``zq1zq``, ...: all distinct, and unlike any other word
    of a task), so that an episode played once can be given fresh names any number of times (``rename``): the
    built-in agent's recipe plays tasks with these, then sees each episode with new names every time."""

    PATTERN = re.compile(r"zq\d+zq")

    def __init__(self, rng: random.Random):
        super().__init__(rng, "seen")
        self.count = 0

    def word(self) -> str:
        self.count += 1
        return f"zq{self.count - 1}zq"


def rename(texts: list[str], names: Names) -> list[str]:
    """``texts`` (one episode's) with each placeholder replaced by a distinct fresh name drawn from ``names``."""
    fresh: dict[str, str] = {}
    for placeholder in sorted({p for t in texts for p in Placeholders.PATTERN.findall(t)}):
        fresh[placeholder] = next(w for w in iter(names.word, None) if w not in fresh.values())
    return [Placeholders.PATTERN.sub(lambda m: fresh[m.group(0)], t) for t in texts]


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


# -- reading the final working directory ---------------------------------------------------------------
# The model's commands made this tree: a link may point at a host file (its content would leak into
# the reward), a FIFO or /proc file may block a read forever. So nothing is followed, only regular
# files are read, and never more than READ_LIMIT bytes.

READ_LIMIT = 1 << 20
NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _open_parent(root: Path, relative: str) -> tuple[int, str] | None:
    """An fd of ``relative``'s parent directory inside ``root`` (no link followed) and its last name."""
    *dirs, name = Path(relative).parts
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | NO_FOLLOW)
    except OSError:
        return None
    for part in dirs:
        try:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | NO_FOLLOW, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = inner
    return fd, name


def lstat_inside(root: Path, relative: str) -> os.stat_result | None:
    """``relative``'s own status (a link is a link), or None where it or a parent is missing or a link."""
    opened = _open_parent(root, relative)
    if opened is None:
        return None
    fd, name = opened
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_inside(root: Path, relative: str) -> str | None:
    """The text of a regular file inside ``root`` (one name, not a hard link to a file elsewhere),
    without its final newlines; None for anything else."""
    opened = _open_parent(root, relative)
    if opened is None:
        return None
    parent, name = opened
    try:
        fd = os.open(name, os.O_RDONLY | NO_FOLLOW, dir_fd=parent)
    except OSError:
        return None
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > READ_LIMIT:
            return None
        return os.read(fd, READ_LIMIT + 1).decode(errors="replace").rstrip("\n")
    except OSError:
        return None
    finally:
        os.close(fd)


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


# -- a user's own tasks ------------------------------------------------------------------------------

def load_tasks(spec: str) -> list[ShellTask]:
    """A user's tasks: a JSONL file of ``{"instruction", "files", "check"}`` lines (see the README),
    or ``module:function`` naming a callable that returns a list of ``ShellTask``."""
    if spec.endswith(".jsonl"):
        return [_task_from_json(row, where) for where, row in json_objects(spec, "tasks")]
    _, sep, name = spec.partition(":")
    if not sep:
        raise UserError(f"tasks {spec!r}: expected a .jsonl file or module:function")
    make = user_callable(spec, "tasks", "env_tasks")
    try:
        tasks = list(make())
    except Exception as e:  # noqa: BLE001 - the user's function: its failure in one line
        raise UserError(f"tasks {spec}: calling {name}() failed: {failure_line(e)}", field="env_tasks") from None
    if not tasks or not all(isinstance(t, ShellTask) for t in tasks):
        raise UserError(f"tasks {spec}: must return a non-empty list of localrl.envs.shell_tasks.ShellTask",
                        field="env_tasks")
    return tasks


_TASK_FIELDS = ("instruction", "files", "check", "family", "level", "solution")
_CHECK_FIELDS = ("answer", "files", "absent", "dirs")


def _task_from_json(row: dict, where: str) -> ShellTask:
    """One line of a tasks file, checked field by field: ``file:line: field: what`` for the first wrong one."""
    unknown = set(row) - set(_TASK_FIELDS)
    if unknown:
        raise UserError(f"{where}: unknown field {sorted(unknown)[0]!r} (a task has {', '.join(_TASK_FIELDS)})")
    instruction = row.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise UserError(f"{where}: instruction: must be a non-empty string (got {_shown(instruction)})")
    files = _path_map(row.get("files", {}), where, "files")
    _no_file_inside_a_file(files, where)
    check = row.get("check")
    if not isinstance(check, dict) or not check or set(check) - set(_CHECK_FIELDS):
        raise UserError(f"{where}: check: must be an object with some of {', '.join(_CHECK_FIELDS)} "
                        f"(got {_shown(check)})")
    answer = check.get("answer")
    if answer is not None and (not isinstance(answer, (str, int, float)) or isinstance(answer, bool)
                               or isinstance(answer, float) and not math.isfinite(answer)):
        raise UserError(f"{where}: check.answer: must be a string or a finite number (got {_shown(answer)})")
    expected = _path_map(check.get("files", {}), where, "check.files")
    absent = _path_list(check.get("absent", []), where, "check.absent")
    dirs = _path_list(check.get("dirs", []), where, "check.dirs")
    family = row.get("family", "user")
    if not isinstance(family, str) or not family.strip():
        raise UserError(f"{where}: family: must be a non-empty string (got {_shown(family)})")
    level = row.get("level", 0)
    if not isinstance(level, int) or isinstance(level, bool) or level < 0:
        raise UserError(f"{where}: level: must be a whole number, 0 or more (got {_shown(level)})")
    solution = row.get("solution", [])
    if not isinstance(solution, list) or not all(isinstance(c, str) and c.strip() for c in solution):
        raise UserError(f"{where}: solution: must be a list of shell commands, each a non-empty string "
                        f"(got {_shown(solution)})")
    return ShellTask(instruction, files, Check(None if answer is None else str(answer), expected, absent, dirs),
                     family, level, tuple(solution))


def _shown(value) -> str:
    """A JSON value as an error shows it (shortened); a missing one as "nothing"."""
    if value is None:
        return "nothing"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _path_map(value, where: str, name: str) -> dict[str, str]:
    """A JSON object of relative path -> text content (``files``, ``check.files``)."""
    if not isinstance(value, dict):
        raise UserError(f"{where}: {name}: must be an object mapping relative paths to text contents "
                        f"(got {_shown(value)})")
    for path, content in value.items():
        _check_path(path, where, name)
        if not isinstance(content, str):
            raise UserError(f"{where}: {name}: the content of {path!r} must be a string (got {_shown(content)})")
    return dict(value)


def _path_list(value, where: str, name: str) -> tuple[str, ...]:
    """A JSON list of relative paths (``check.absent``, ``check.dirs``)."""
    if not isinstance(value, list):
        raise UserError(f"{where}: {name}: must be a list of relative paths (got {_shown(value)})")
    for path in value:
        _check_path(path, where, name)
    return tuple(value)


def _check_path(path, where: str, name: str) -> None:
    if not isinstance(path, str) or not _relative(path):
        raise UserError(f"{where}: {name}: path {path!r} must be relative and stay inside the working directory")


def _no_file_inside_a_file(files: dict[str, str], where: str) -> None:
    """Starting files that cannot all be made: ``a`` a file and ``a/b`` inside it, or one path twice."""
    seen: dict[tuple[str, ...], str] = {}
    for path in files:
        parts = Path(path).parts
        if parts in seen:
            raise UserError(f"{where}: files: {seen[parts]!r} and {path!r} are the same path")
        seen[parts] = path
    for path in files:
        if path.endswith("/"):
            continue  # an empty directory: others may be inside it
        parts = Path(path).parts
        for other in files:
            if other != path and Path(other).parts[:len(parts)] == parts:
                raise UserError(f"{where}: files: {path!r} is a file, so {other!r} cannot be inside it")


def _relative(path: str) -> bool:
    parts = Path(path).parts
    return bool(parts) and not Path(path).is_absolute() and ".." not in parts
