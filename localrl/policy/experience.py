"""Training-free GRPO (Cai et al., 2025, "Training-Free Group Relative Policy Optimization"): learn in
the prompt instead of the weights.

A run with ``objective = "experience"`` keeps an experience library: a short numbered list of
natural-language lessons, given to the model in its system message. Each step samples a group of
completions per prompt with the library in context and scores them as GRPO does; for each group
whose completions part into right and wrong (the group-relative signal), a judge (the policy model
itself, or the model named by ``experience_judge``) is shown the problem, its reference answer,
one right and one wrong completion and the library, and answers with edits, one a line:

    ADD: <lesson>
    MODIFY <n>: <lesson>
    DELETE <n>
    KEEP

While the library is empty the judge's reply is begun for it with ``ADD:`` (adding is then the only
edit there can be, and a small judge otherwise tends to echo the request). Edits apply in order; one
that names no lesson of the library, or whose text is not a lesson (fewer than three words of
letters: a bare number or sum, which small judges write), is counted as invalid and skipped. The library holds at most ``capacity`` lessons (an ADD to
a full library drops the oldest) of at most ``MAX_LESSON_CHARS`` characters each. No weight is
updated: the adapter stays as it was initialised. The library is written to the run directory
(``experience.json``, atomically, after every step and with every checkpoint, so a resumed run
continues with the library it had), evaluation after training reads it, and ``localrl chat
--experience RUN`` and ``localrl eval RUN`` prepend it as training did.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from localrl.atomic import write_text_atomic
from localrl.errors import UserError
from localrl.runs import EXPERIENCE, Run

MAX_LESSON_CHARS = 240
DEFAULT_LIBRARY_TOKENS = 256  # the lessons' room in each prompt, unless experience_tokens says otherwise
LESSONS_JOIN = "\n\n"  # between the task's own system message and the lessons
MIN_LESSON_WORDS = 3
HEADER = "Lessons from earlier attempts at such problems:"

JUDGE_SYSTEM = ("You maintain a short list of general lessons that help solve problems of one kind. You are "
                "shown a problem, its reference answer, a right and a wrong attempt, and the current lessons. "
                "Reply only with edits to the lessons, one per line, each one of: 'ADD: <lesson>', "
                "'MODIFY <number>: <lesson>', 'DELETE <number>', 'KEEP'. A lesson is one short sentence "
                "that would help on other problems of this kind, not only this one.")

_OP = re.compile(r"^\s*(?:[-*]\s*|\d+[.)]\s*)?(ADD|MODIFY|DELETE|KEEP)\b\s*(?:#|\[)?\s*(\d+)?\]?\s*[:\-]?\s*(.*)$",
                 re.IGNORECASE)


@dataclass(frozen=True)
class Edit:
    """One edit to the library: ``op`` add, modify, delete or keep; ``lesson`` the number it names (modify,
    delete); ``text`` the lesson's text (add, modify)."""

    op: str
    lesson: int | None = None
    text: str = ""


def parse_edits(reply: str) -> list[Edit]:
    """The edits in a judge's reply, one a line; lines that are not an edit are ignored (a small model
    wraps its answer in prose). An edit missing its number or text is kept, to be counted invalid."""
    edits = []
    for line in reply.splitlines():
        match = _OP.match(line)
        if match is None:
            continue
        op, number, text = match.group(1).lower(), match.group(2), match.group(3).strip().strip('"').strip()
        edits.append(Edit(op, int(number) if number else None, _clip(text)))
    return edits


def _clip(text: str) -> str:
    text = " ".join(text.split())
    if len(text) <= MAX_LESSON_CHARS:
        return text
    cut = text[:MAX_LESSON_CHARS].rsplit(" ", 1)[0]
    return cut or text[:MAX_LESSON_CHARS]


def is_lesson(text: str) -> bool:
    """Whether ``text`` reads as a lesson: at least ``MIN_LESSON_WORDS`` words of letters (a bare number or a
    sum such as "7+4=11", which small judges write, is not one)."""
    return sum(any(c.isalpha() for c in word) for word in text.split()) >= MIN_LESSON_WORDS


@dataclass
class ExperienceLibrary:
    """The lessons, by stable number (a number is never reused, so an edit names the lesson it saw)."""

    capacity: int = 12
    lessons: dict[int, str] = field(default_factory=dict)  # number -> text, oldest first
    next_number: int = 1
    # whether the lessons' block (as the prompt gets it) fits the room the run keeps for it; None: any does
    within: Callable[[str], bool] | None = field(default=None, compare=False, repr=False)

    def add(self, text: str) -> int | None:
        """Add a lesson; the oldest make room (beyond ``capacity`` lessons, or the room in the prompt). None, and
        nothing changed, where the lesson alone does not fit the room."""
        text = _clip(text)
        if not self._fits({0: text}):
            return None
        if len(self.lessons) >= self.capacity:
            del self.lessons[next(iter(self.lessons))]  # the oldest makes room
        number, self.next_number = self.next_number, self.next_number + 1
        self.lessons[number] = text
        self.trim()
        return number

    def tokens(self, tok) -> int:
        """The tokens of ``tok`` the lessons add to a prompt (0 while there are none)."""
        return _token_count(tok, _block(self.lessons)) if self.lessons else 0

    def trim(self) -> int:
        """Drop the oldest lessons until the rest fit the room; how many were dropped."""
        dropped = 0
        while len(self.lessons) > 1 and not self._fits(self.lessons):
            del self.lessons[next(iter(self.lessons))]
            dropped += 1
        return dropped

    def _fits(self, lessons: dict[int, str]) -> bool:
        return self.within is None or not lessons or self.within(_block(lessons))

    def apply(self, edits: list[Edit]) -> tuple[int, int]:
        """Apply ``edits`` in order: (how many changed the library, how many were invalid); KEEP is neither."""
        changed = invalid = 0
        for e in edits:
            if e.op == "keep":
                continue
            if e.op == "add" and is_lesson(e.text) and e.text not in self.lessons.values() and \
                    self.add(e.text) is not None:
                pass
            elif e.op == "modify" and e.lesson in self.lessons and is_lesson(e.text) and \
                    self._fits({**self.lessons, e.lesson: e.text}):
                self.lessons[e.lesson] = e.text
            elif e.op == "delete" and e.lesson in self.lessons:
                del self.lessons[e.lesson]
            else:
                invalid += 1
                continue
            changed += 1
        return changed, invalid

    def numbered(self) -> str:
        return _numbered(self.lessons)

    def system(self, base: str | None) -> str | None:
        """The system message with the library: ``base`` (the task's own, if any), then the lessons; ``base``
        unchanged while the library is empty."""
        if not self.lessons:
            return base
        block = _block(self.lessons)
        return f"{base}{LESSONS_JOIN}{block}" if base else block

    def state(self) -> dict:
        return {"capacity": self.capacity, "next_number": self.next_number,
                "lessons": [{"number": n, "text": t} for n, t in self.lessons.items()]}

    @classmethod
    def from_state(cls, state: dict) -> ExperienceLibrary:
        return cls(int(state["capacity"]), {int(x["number"]): str(x["text"]) for x in state["lessons"]},
                   int(state["next_number"]))

    def save(self, path: str | Path) -> Path:
        """Write the library to ``path`` (a run's ``experience_path``), atomically."""
        write_text_atomic(Path(path), json.dumps(self.state(), indent=1) + "\n")
        return Path(path)


def _numbered(lessons: dict[int, str]) -> str:
    return "\n".join(f"[{n}] {text}" for n, text in lessons.items())


def _block(lessons: dict[int, str]) -> str:
    return f"{HEADER}\n{_numbered(lessons)}"


def _token_count(tok, block: str) -> int:
    """The tokens of a lessons block in a prompt (the separator from the task's own system message counted)."""
    return len(tok(LESSONS_JOIN + block, add_special_tokens=False)["input_ids"])


def token_room(tok, tokens: int) -> Callable[[str], bool]:
    """``ExperienceLibrary.within`` for a room of ``tokens`` tokens of ``tok``."""
    return lambda block: _token_count(tok, block) <= tokens


def library_tokens(setting: int, context: int | None) -> int:
    """The room the lessons get in every prompt: ``experience_tokens``, or (0) a quarter of the context, at most
    ``DEFAULT_LIBRARY_TOKENS``."""
    if setting:
        return setting
    return min(DEFAULT_LIBRARY_TOKENS, context // 4) if context else DEFAULT_LIBRARY_TOKENS


def initial_library(capacity: int, source: str = "") -> ExperienceLibrary:
    """A run's library at its start: empty, or ``source``'s lessons (the newest ``capacity`` of them)."""
    if not source:
        return ExperienceLibrary(capacity)
    loaded = load_library(source)
    keep = list(loaded.lessons.items())[-capacity:]
    return ExperienceLibrary(capacity, dict(keep), loaded.next_number)


def load_library(source: str | Path) -> ExperienceLibrary:
    """The library of a run directory (its ``experience.json``), of such a file, or of a text file of lessons
    written by hand (``.txt``, one a line); one clear error otherwise."""
    path = Path(source)
    path = Run(path).experience_path if path.is_dir() else path
    if not path.is_file():
        raise UserError(f"experience {source}: no {EXPERIENCE} there (a run trained with objective = experience "
                        f"writes one)" if path.name == EXPERIENCE else f"experience {source}: no such file")
    text = _read_utf8(path)
    if path.suffix == ".txt":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        library = ExperienceLibrary(capacity=max(len(lines), 1))
        library.apply([Edit("add", text=line) for line in lines])
        return library
    try:
        return ExperienceLibrary.from_state(json.loads(text))
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"experience {path}: not an experience library ({type(e).__name__}: {e})") from None


def _read_utf8(path: Path) -> str:
    """A library file's text; one line naming the file, line and byte when it is not UTF-8 or not readable."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"experience {path}: cannot be read ({e.strerror})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"experience {path}:{line}: not UTF-8 text (byte {data[e.start]:#04x}); save the lessons "
                        f"as UTF-8") from None


def judge_request(question: str, answer: str, right: str, wrong: str, library: ExperienceLibrary) -> list[dict]:
    """The chat messages that ask the judge how the library should change after one group."""
    lessons = library.numbered() or "(none yet)"
    user = (f"Problem:\n{question}\n\nReference answer: {answer}\n\nA right attempt:\n{right}\n\n"
            f"A wrong attempt:\n{wrong}\n\nCurrent lessons:\n{lessons}\n\n"
            f"Edits (one per line: ADD: <lesson> / MODIFY <number>: <lesson> / DELETE <number> / KEEP):")
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


def reply_start(library: ExperienceLibrary) -> str:
    """How the judge's reply begins: with "ADD:" while the library is empty, where adding is the only edit
    there can be (a small judge then writes a lesson instead of echoing the request); else as it likes."""
    return "" if library.lessons else "ADD:"


def contrasting_pairs(rows: list[dict], completions: list[str], correct: list[float],
                      group_size: int) -> list[tuple[dict, str, str]]:
    """(row, a right completion, a wrong one) of each group whose completions part into right and wrong:
    the group's first of each."""
    pairs = []
    for b, row in enumerate(rows):
        group = list(zip(completions[b * group_size:(b + 1) * group_size], correct[b * group_size:(b + 1) * group_size]))
        right = next((t for t, ok in group if ok == 1.0), None)
        wrong = next((t for t, ok in group if ok != 1.0), None)
        if right is not None and wrong is not None:
            pairs.append((row, right, wrong))
    return pairs


def question_text(prompt) -> str:
    """A row's prompt as text: the string, or its user messages."""
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt if m.get("role") == "user")


class Judge:
    """A model that answers judge requests greedily, batched (``experience_judge``, or the policy itself)."""

    def __init__(self, model, tok, max_new_tokens: int, context: int | None, at_once: int | None = None):
        self.model, self.tok, self.max_new_tokens, self.context = model, tok, max_new_tokens, context
        self.at_once = at_once  # requests decoded at a time (None: all), as the memory budget holds

    def __call__(self, requests: list[list[dict]], start: str = "") -> list[str | None]:
        """Each request's reply, begun with ``start`` (written for the judge, then continued by it); None for
        one that does not fit the judge's context with its reply."""
        from localrl.generation.rollout import decode_completions, encode_prompts, sample_in_chunks, stop_token_ids

        begun = self.tok(start, add_special_tokens=False)["input_ids"] if start else []
        prompts = [p + begun for p in encode_prompts(self.tok, [{"prompt": r} for r in requests])]
        fits = [self.context is None or len(p) + self.max_new_tokens <= self.context for p in prompts]
        kept = [p for p, ok in zip(prompts, fits) if ok]
        replies = iter([])
        if kept:
            was_training = self.model.training
            self.model.eval()
            rollout = sample_in_chunks(self.model, kept, 1, self.max_new_tokens, stop_token_ids(self.tok, self.model),
                                       self.tok.pad_token_id, 0.0, None, self.at_once or len(kept))
            self.model.train(was_training)
            replies = iter(decode_completions(self.tok, rollout))
        return [start + next(replies) if ok else None for ok in fits]


class EndpointJudge:
    """The judge behind an OpenAI-compatible endpoint (``experience_judge = http://...|MODEL``): a larger model a
    user already runs (Ollama, llama.cpp's server, vLLM, ``localrl serve``). Its reply is not begun for it (a
    server's chat API writes the whole reply); a request that failed after its retries is an empty reply (no
    edit), counted in ``take_stats`` with the requests, retries and cached replies."""

    def __init__(self, endpoint, max_new_tokens: int):
        self.endpoint, self.max_new_tokens = endpoint, max_new_tokens

    def __call__(self, requests: list[list[dict]], start: str = "") -> list[str]:
        return [reply or "" for reply in self.endpoint.chat(requests, self.max_new_tokens)] if requests else []

    def take_stats(self) -> dict[str, int]:
        return self.endpoint.take_stats("judge_")


def judge_load(cfg, tok, context: int | None, shape, weights: int, longest_prompt: int):
    """The judge's share of a run's memory, a decoding phase of the objective's own (``memory.DecodingPhase``):
    ``weights`` held all run (0: the policy judges itself), and each step up to one request a prompt, each at
    most the request's template, the longest prompt, two attempts and a full library (a lesson's characters
    counted as tokens), within the judge's context."""
    from localrl.generation.rollout import encode_prompts
    from localrl.memory import DecodingPhase

    template = len(encode_prompts(tok, [{"prompt": judge_request("", "", "", "", ExperienceLibrary())}])[0])
    longest = template + longest_prompt + 2 * cfg.max_new_tokens + cfg.experience_size * MAX_LESSON_CHARS
    if context:
        longest = min(longest, context - cfg.experience_judge_tokens)
    return DecodingPhase("judging", shape, weights, cfg.prompts_per_step, longest, cfg.experience_judge_tokens,
                         who="the judge")


def check_judge_fits(tok, context: int | None, max_new_tokens: int, reply_tokens: int, where: str) -> None:
    """Refuse a judge whose context cannot hold the shortest request (two attempts of ``max_new_tokens``
    each, an empty library) and its reply."""
    if context is None:
        return
    empty = ExperienceLibrary()
    from localrl.generation.rollout import encode_prompts

    need = len(encode_prompts(tok, [{"prompt": judge_request("", "", "", "", empty)}])[0]) + 2 * max_new_tokens
    if need + reply_tokens > context:
        raise UserError(f"config field experience_judge: {where} has a context of {context} tokens; a judge request "
                        f"needs at least {need} and its reply {reply_tokens} (name a larger judge with "
                        f"experience_judge)", field="experience_judge")
