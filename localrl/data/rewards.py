"""Verifiable rewards: plain callables ``(completions, **columns) -> list[float]``.

``completions`` are the decoded completion strings; every other column of the dataset
row (``answer`` and any extras) arrives as a keyword argument holding one value per
completion. Add your own reward by writing such a function and naming it
``package.module:function`` in the config, or by passing it to ``localrl.train``.

The answer a model gives is read the way models write it: the text inside its last
``<answer>...</answer>`` when there is one, else its final line (for numbers: the last
number in the completion). Whether the completion has the ``<think>/<answer>`` format is
a separate reward (``format``), added with its own weight, so a real model that answers
right in prose scores for being right and learns the format from the small bonus.

Besides the dataset's columns, every reward gets ``completion_ids`` (each completion's token ids,
its stop token included), as TRL passes them, so length-aware rewards such as DAPO's soft
overlong punishment (``overlong_punishment``) can be written and reused from TRL unchanged.
"""

from __future__ import annotations

import math
import re
from typing import Callable

from localrl.data.arithmetic import parse_question
from localrl.data.calibration import TRAILING_CONFIDENCE, brier_penalty
from localrl.data.drafts import draft_lines, working
from localrl.data.groups import prompt_groups
from localrl.data.judge import PREFIX as JUDGE_PREFIX
from localrl.data.judge import judge_reward
from localrl.errors import UserError, failure_line, user_callable
from localrl.generation.endpoint import EndpointSettings

RewardFn = Callable[..., list[float]]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
# the format, with the optional confidence a calibration run states after its answer
_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*" + TRAILING_CONFIDENCE + "$", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_LEAD = re.compile(r"^(?:\**\s*(?:final\s+)?answer\s*\**\s*[:=]\s*)", re.IGNORECASE)


def extract_answer(text: str) -> str | None:
    """The content of the last ``<answer>`` tag, stripped; None if there is none."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def final_line(text: str) -> str:
    """The last non-empty line outside any ``<think>`` section, without an "Answer:" lead-in."""
    lines = [line.strip() for line in _THINK.sub("", text).splitlines() if line.strip()]
    return _LEAD.sub("", lines[-1]).strip() if lines else ""


def given_answer(text: str) -> str:
    """What a completion answers: its tagged answer, else its final line."""
    tagged = extract_answer(text)
    return tagged if tagged is not None else final_line(text)


def _normalise(text: str) -> str:
    return " ".join(text.strip().rstrip(".!").split()).casefold()


def _to_number(text: str) -> float | None:
    match = _NUMBER.search(text)
    if match is None:
        return None
    try:
        return float(match.group(0).replace(",", ""))
    except ValueError:
        return None


def numeric_match(completions: list[str], answer: list, **_) -> list[float]:
    """1.0 where the answer's number equals the reference number: the first number in the answer tag,
    or without a tag the last number in the completion ("457 + 68 = 525" answers 525)."""
    out = []
    for text, ref in zip(completions, answer):
        tagged = extract_answer(text)
        if tagged is not None:
            got = _to_number(tagged)
        else:
            numbers = _NUMBER.findall(_THINK.sub("", text))
            got = _to_number(numbers[-1]) if numbers else None
        want = _to_number(str(ref))
        out.append(float(got is not None and want is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)))
    return out


def exact_match(completions: list[str], answer: list, **_) -> list[float]:
    """1.0 where the answer (tagged, else the final line) equals the reference, ignoring case, spacing
    and a final period."""
    return [float(_normalise(given_answer(t)) == _normalise(str(ref))) for t, ref in zip(completions, answer)]


def regex_match(completions: list[str], answer: list, **_) -> list[float]:
    """1.0 where the answer (tagged, else the final line) fully matches the row's ``answer``, read as a
    regular expression."""
    return [float(re.fullmatch(str(pattern), given_answer(text)) is not None)
            for text, pattern in zip(completions, answer)]


def format_reward(completions: list[str], **_) -> list[float]:
    """1.0 where the completion is exactly ``<think>...</think><answer>...</answer>``, optionally followed by
    one ``<confidence>...</confidence>``."""
    return [float(_FORMAT.match(t) is not None) for t in completions]


def draft_edits(completions: list[str], prompt: list, draft: list[str], answer: list, **_) -> list[float]:
    """``data = drafts``' edit term: on a right answer (``numeric_match``), minus the share of the draft's right column
    lines that the completion changed (read against the true working of the question in the prompt); 0 on a wrong
    answer, a draft with no right line, or a question it cannot read. Ungated, the term was won by copying the draft's
    right lines and never answering (docs/contrast.md)."""
    out = []
    for text, p, d, right_answer in zip(completions, prompt, draft, numeric_match(completions, answer)):
        question = p if isinstance(p, str) else " ".join(m["content"] for m in p if m.get("role") == "user")
        asked = parse_question(question)
        if asked is None or not right_answer:
            out.append(0.0)
            continue
        truth, given, written = working(asked)[0], draft_lines(d), draft_lines(text)
        right = [i for i, line in enumerate(given) if i < len(truth) and line == truth[i]]
        changed = sum(i >= len(written) or written[i] != given[i] for i in right)
        out.append(-changed / len(right) if right else 0.0)
    return out


class overlong_punishment:
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13; TRL's ``get_soft_overlong_punishment``):
    0 up to ``max_len - cache`` tokens, then falling linearly to -1 at ``max_len``, and -1 beyond. A
    completion cut at the token limit has given no answer the reward can trust (its "last number" is
    wherever it was cut), and it costs the longest decode: this teaches a model to finish in time."""

    __name__ = "overlong"

    def __init__(self, max_len: int, cache: int):
        self.max_len, self.cache = max_len, cache

    def __call__(self, completions: list[str], completion_ids: list[list[int]], **_) -> list[float]:
        start = self.max_len - self.cache
        return [0.0 if len(ids) <= start else -1.0 if len(ids) > self.max_len else (start - len(ids)) / self.cache
                for ids in completion_ids]


class length_penalty:
    """Kimi k1.5's length reward (Kimi Team, 2025, section 2.3.3), for a shrinking-budget curriculum: within
    each group (the consecutive completions of one prompt) lambda = 0.5 - (len - shortest) / (longest -
    shortest), 0 when all are as long; a right completion (by ``correct``, the run's correctness reward)
    gets lambda, a wrong one min(0, lambda). Among right answers the shorter earn more; a long wrong one
    pays."""

    __name__ = "length"

    def __init__(self, correct: RewardFn):
        self.correct = correct

    def __call__(self, completions: list[str], completion_ids: list[list[int]], **columns) -> list[float]:
        right = self.correct(completions, completion_ids=completion_ids, **columns)
        prompts = columns.get("prompt", [None] * len(completions))
        out = []
        for start, end in prompt_groups(prompts):
            lengths = [len(ids) for ids in completion_ids[start:end]]
            lo, hi = min(lengths), max(lengths)
            for n, ok in zip(lengths, right[start:end]):
                lam = 0.0 if hi == lo else 0.5 - (n - lo) / (hi - lo)
                out.append(lam if ok == 1.0 else min(0.0, lam))
        return out


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "numeric": numeric_match,
    "exact": exact_match,
    "regex": regex_match,
    "format": format_reward,
    "draft_edits": draft_edits,
}


def resolve_reward(spec: str, judge: EndpointSettings | None = None) -> RewardFn:
    """A built-in reward by name, a judge model behind an endpoint (``judge:URL|MODEL``, asked as ``judge``
    says), or a user function named ``package.module:function``."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if spec.startswith(JUDGE_PREFIX):
        return judge_reward(spec, judge or EndpointSettings())
    if ":" in spec:
        return user_callable(spec, "reward", "reward")
    raise UserError(f"reward {spec!r}: unknown; use one of {', '.join(BUILTIN_REWARDS)}, judge:URL|MODEL or "
                    f"package.module:function",
                    field="reward")


def resolve_rewards(spec: str, weights: str = "", judge: EndpointSettings | None = None
                    ) -> tuple[list[RewardFn], list[float]]:
    """The rewards a config names (``spec``: comma-separated names, ``judge:URL|MODEL`` or
    ``package.module:function``) and their weights (``weights``: comma-separated numbers, one per reward; empty:
    1 each)."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise UserError("config field reward: names no reward", field="reward")
    fns = [resolve_reward(name, judge) for name in names]
    if not weights.strip():
        return fns, [1.0] * len(fns)
    try:
        values = [float(w) for w in weights.split(",")]
    except ValueError:
        raise UserError(f"config field reward_weights: {weights!r} is not a comma-separated list of numbers",
                        field="reward_weights") from None
    if len(values) != len(fns):
        raise UserError(f"config field reward_weights: {len(values)} weights for {len(fns)} rewards ({spec})",
                        field="reward_weights")
    if not all(math.isfinite(v) for v in values):
        raise UserError(f"config field reward_weights: {weights!r} must be finite numbers", field="reward_weights")
    return fns, values


def default_rewards(reward: str, format_weight: float, overlong_cache: int = 0, max_new_tokens: int = 0,
                    reward_weights: str = "", check: RewardFn | None = None, length_weight: float = 0.0,
                    calibration_weight: float = 0.0, judge: EndpointSettings | None = None
                    ) -> tuple[list[RewardFn], list[float]]:
    """The rewards named in a config (the first is the correctness reward that accuracy counts), each at its
    weight, then the weighted format reward, then (with an ``overlong_cache``) the soft overlong punishment
    at weight 1, as in DAPO, then (with a ``length_weight``) Kimi's length reward at that weight, then (with a
    ``calibration_weight``) RLCR's Brier term at that weight, then the ``check`` reward at weight 0: logged,
    never trained on."""
    fns, weights = resolve_rewards(reward, reward_weights, judge)
    correct = fns[0]
    fns, weights = fns + [format_reward], weights + [format_weight]
    if overlong_cache > 0:
        fns.append(overlong_punishment(max_new_tokens, overlong_cache))
        weights.append(1.0)
    if length_weight > 0:
        fns.append(length_penalty(correct))
        weights.append(length_weight)
    if calibration_weight > 0:
        fns.append(brier_penalty(correct))
        weights.append(calibration_weight)
    if check is not None:
        fns.append(check)
        weights.append(0.0)
    return fns, weights


def config_rewards(cfg, check: RewardFn | None = None) -> tuple[list[RewardFn], list[float]]:
    """``default_rewards`` of a run config (a ``TrainConfig``), with ``check`` at weight 0."""
    return default_rewards(cfg.reward, cfg.format_weight, cfg.overlong_cache, cfg.max_new_tokens, cfg.reward_weights,
                           check, cfg.length_reward_weight, cfg.calibration_weight, EndpointSettings.of(cfg))


def reward_name(fn: RewardFn, index: int) -> str:
    """How a reward is called in metrics and samples: its function name, else its position."""
    return getattr(fn, "__name__", f"reward{index}")


def reward_names(fns: list[RewardFn]) -> list[str]:
    """Each reward's name in metrics, made distinct where two share one (``numeric``, ``numeric_2``)."""
    names: list[str] = []
    for i, fn in enumerate(fns):
        name, k = reward_name(fn, i), 2
        while name in names:
            name, k = f"{reward_name(fn, i)}_{k}", k + 1
        names.append(name)
    return names


def score(reward_fns: list[RewardFn], completions: list[str], columns: dict[str, list]) -> list[list[float]]:
    """Each reward function's scores (one list per function), checked for length."""
    all_scores = []
    for i, fn in enumerate(reward_fns):
        name = reward_name(fn, i)
        try:
            scores = list(fn(completions, **columns))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - a user's function: say which failed and how, in one line
            raise UserError(f"reward {name} failed: {failure_line(e)}", field="reward") from None
        if len(scores) != len(completions):
            raise UserError(f"reward {name} returned {len(scores)} scores for {len(completions)} completions",
                            field="reward")
        try:
            values = [float(s) for s in scores]
        except (TypeError, ValueError):
            raise UserError(f"reward {name} returned a score that is not a number: "
                            f"{next(s for s in scores if not isinstance(s, (int, float)))!r}", field="reward") from None
        bad = next((k for k, v in enumerate(values) if not math.isfinite(v)), None)
        if bad is not None:
            raise UserError(f"reward {name} returned {values[bad]} for completion {bad}: scores must be finite",
                            field="reward")
        all_scores.append(values)
    return all_scores


def reward_stats(reward_fns: list[RewardFn]) -> dict[str, int]:
    """What the rewards that count their work (a judge's requests and failures: ``take_stats``) did since they
    were last asked."""
    out: dict[str, int] = {}
    for fn in reward_fns:
        take = getattr(fn, "take_stats", None)
        if take is not None:
            for key, value in take().items():
                out[key] = out.get(key, 0) + value
    return out


def combine(scores: list[list[float]], weights: list[float]) -> list[float]:
    """Weighted sum of the reward functions' scores, per completion."""
    return [sum(w * s for w, s in zip(weights, col)) for col in zip(*scores)]
