"""An LLM as the judge of a completion: ``--reward judge:URL|MODEL``, a model behind an OpenAI-compatible
endpoint (``localrl.generation.endpoint``) that grades each completion against the problem and its reference
answer with a fixed rubric and replies ``Score: N`` (0 to 10); the reward is N / 10.

A completion whose judgement failed (after the endpoint's retries) or whose reply holds no score is never
scored 0: it gets the mean score of the judged completions of its group (of the call, where none of its group
was judged), which leaves its group-relative advantage from this reward at about 0, and it is counted
(``judge_failed``, ``judge_unparsed`` in the step's record, beside ``judge_requests``, ``judge_retries`` and
``judge_cached``). A call in which no completion could be judged stops the run in one line naming the judge
and its last error: a run that trains on no judgement is no run.
"""

from __future__ import annotations

import re

from localrl.data.groups import prompt_groups
from localrl.errors import UserError
from localrl.generation.endpoint import Endpoint, EndpointSettings

PREFIX = "judge:"
MAX_SCORE = 10
REPLY_TOKENS = 64  # "Score: N", with room for a sentence before it

RUBRIC = ("You grade answers to problems. You are shown a problem, its reference answer and an answer to grade. "
          "Score the answer from 0 to 10: 10 if its final result agrees with the reference answer and its "
          "reasoning is sound, 0 if its final result is wrong or missing, and between for an answer that is "
          "partly right. Reply with one line: 'Score: N'.")

_SCORE = re.compile(r"score\s*(?:\*\*)?\s*[:=]?\s*(?:\*\*)?\s*(\d+(?:\.\d+)?)\s*(?:/\s*10)?", re.IGNORECASE)


def grading_request(prompt, answer, completion: str) -> list[dict]:
    """The chat messages that ask the judge to grade one completion."""
    question = prompt if isinstance(prompt, str) else "\n".join(
        m.get("content", "") for m in prompt or [] if isinstance(m, dict) and m.get("role") == "user")
    user = (f"Problem:\n{question}\n\nReference answer: {answer}\n\nAnswer to grade:\n{completion}\n\n"
            f"Reply with 'Score: N' (N from 0 to {MAX_SCORE}).")
    return [{"role": "system", "content": RUBRIC}, {"role": "user", "content": user}]


def parse_score(reply: str) -> float | None:
    """The reply's score over ``MAX_SCORE``, in [0, 1]; None where it states none (or one out of range)."""
    found = _SCORE.search(reply)
    if found is None:
        return None
    value = float(found.group(1))
    return value / MAX_SCORE if 0 <= value <= MAX_SCORE else None


class judge_reward:
    """``judge:URL|MODEL`` as a reward function (TRL's signature: completions, then the dataset's columns)."""

    __name__ = "judge"

    def __init__(self, spec: str, settings: EndpointSettings = EndpointSettings()):
        self.endpoint = Endpoint(spec[len(PREFIX):], "reward", settings)
        self.unparsed = 0

    def __call__(self, completions: list[str], prompt: list | None = None, answer: list | None = None,
                 **_) -> list[float]:
        n = len(completions)
        prompts, answers = prompt or [""] * n, answer or [""] * n
        replies = self.endpoint.chat([grading_request(p, a, c) for p, a, c in zip(prompts, answers, completions)],
                                     REPLY_TOKENS)
        scores = [None if r is None else parse_score(r) for r in replies]
        self.unparsed += sum(r is not None and s is None for r, s in zip(replies, scores))
        judged = [s for s in scores if s is not None]
        if not judged:
            why = f"its last error: {self.endpoint.last_error}" if any(r is None for r in replies) else \
                f"no reply stated a score (the first: {' '.join(str(replies[0]).split())[:120]!r})"
            raise UserError(f"reward judge: {self.endpoint!r} judged none of {n} completions; {why}", field="reward")
        overall = sum(judged) / len(judged)
        out: list[float] = []
        for start, end in prompt_groups(prompts):
            mine = [s for s in scores[start:end] if s is not None]
            fill = sum(mine) / len(mine) if mine else overall
            out += [fill if s is None else s for s in scores[start:end]]
        return out

    def take_stats(self) -> dict[str, int]:
        stats = self.endpoint.take_stats("judge_")
        stats["judge_unparsed"], self.unparsed = self.unparsed, 0
        return stats
