"""The names shell tasks are made of. File, directory and word names come from a large vocabulary (words people name
files with, and made-up pronounceable names), so an agent must read each name from its task rather than recall it.
The vocabulary is split in two: training tasks use only ``seen`` names, and the held-out evaluation uses only
``unseen`` ones, so its figure is for names the model never met. The README's examples (EXAMPLE_NAMES) are unseen."""

from __future__ import annotations

import hashlib
import random
import re

EXTS = ("txt", "log", "csv", "md", "tmp", "json")
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
