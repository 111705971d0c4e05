"""Prove a GGUF file right: load it in llama.cpp (llama-cpp-python) and compare with the torch model.

The checks, each against the full-precision torch model the file was written from:
- tokenisation of a sample text (special tokens included) is identical;
- next-token logits on sample prompts agree on the top-1 token at 99% of the decisive positions, those
  where torch's top token leads the next by a margin the file's type cannot plausibly undo: 0.5 logits for
  f32/f16/bf16, 2 for quantised types (f32, f16, bf16, q8_0 judged; lower-bit types reported). A model
  with too few of them, like the tests' random ones whose logits are near-uniform, must agree at every
  decisive position it has, and (the report says so in a note) f32/f16/bf16 at 99% of all positions;
  q8_0 has its logits within 10% of their range at the median position instead, since over all positions
  of a random model its top-1 is a coin toss (a random Qwen2.5-1.5B-shape file: 82.8%, its logits within
  3.5% of their range; SmolLM2's q8_0 2.4-3.0%, the built-in model's 0.7%, its q4_0 5%);
- for f32/f16/bf16 the logits are close: at the median position the largest difference is a small
  fraction of that position's logit range (0.2%; 2% for bf16), and at the worst position four times that.
  Top-1 agreement alone misses a wrong layout in a model whose attention is still nearly uniform: random
  test models without the rotary permutation sit at 0.43-0.49% at the median position, without their rope
  scaling at 0.25-0.40%, with everything right at 0.01-0.06%; SmolLM2-135M's f16 files, base and merged
  after two GRPO steps (five runs), at 0.08-0.10% (0.42% at the worst position). The margin is 2x on the
  real side and 1.25x on the random side: a gate for what is wrong, not a measure of what is right;
- for f32/f16 the greedy continuation of each prompt is identical up to torch's first near-tie, a step
  whose top two tokens are closer than the decisive margin or than twice the largest logit difference
  the prompt showed between the two engines, whichever is less (after it, either engine's choice is
  right and the continuations part). It is the check of llama.cpp's one-token decode from its cache.

Each distinct context is judged once (the sample prompts share their system prompt, and a flip there
would count once per prompt). Near-ties decide nothing because they decide by rounding: SmolLM2-135M's
llama.cpp q8_0 agreed 96.2% at all positions on one machine and 94.2% on another, every flip at a
margin under 0.3 logits; after two GRPO steps its merged f16 file agreed 98.7% at all positions and at
every decisive one, with a mean KL of 0.00001 nats. q8_0 moved the logits of that run's model by 1.1
at the median position and 3.1 at the worst, where a token that led by 0.88 flipped (a 0.5-logit
margin failed the file, on llama.cpp's own quantisation of an f16 file that had passed). The worst
position is judged loosely for the same reason: f16's arithmetic (llama.cpp rounds activations to f16
for f16 weights) compounds over 30 layers at a few positions.

Next to top-1 agreement it reports the mean KL divergence of llama.cpp's next-token distribution
from torch's, as llama.cpp's perplexity tool does: on a large vocabulary, top-1 agreement of a
quantised file sits at the noise level of a few near-ties, the KL divergence does not. Quantised
types are llama.cpp's own quantisation of a validated f16 file (export.py), so their figures are
what llama.cpp's quantizer does to the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

DECISIVE_TOP1_REQUIRED = {"f32": 0.99, "f16": 0.99, "bf16": 0.99, "q8_0": 0.99}  # at the decisive positions
DECISIVE_MARGIN = 0.5  # logits, for f32/f16/bf16
QUANTISED_DECISIVE_MARGIN = 2.0  # logits, for llama.cpp's quantised types
# A model with fewer decisive positions than this (a random test model's logits are near-uniform) is judged
# over all positions as well, at these floors
MIN_DECISIVE = 20
TOP1_REQUIRED = {"f32": 0.99, "f16": 0.99, "bf16": 0.99}  # top-1 over all positions
UNDECIDED_CLOSENESS = {"q8_0": 0.10}  # max |logit diff| / logit range at the median position
CLOSENESS_REQUIRED = {"f32": 0.002, "f16": 0.002, "bf16": 0.02}  # max |logit diff| / logit range, median position
WORST_POSITION_FACTOR = 4  # the worst position may differ this many times the median's bound
GREEDY_REQUIRED = {"f32", "f16"}
SAMPLE_TEXT = ("Hello world! What is 457 + 68? Add the units, then the tens. <think>7+8=15</think><answer>525</answer>"
               "\n  tabs\tand é ü 中文")
SAMPLE_QUESTIONS = ["What is 457 + 68?", "What is 9 + 1234?", "Name three colours.", "What is 70 + 35?",
                    "Write a haiku about the sea.", "Why is the sky blue?", "List the files in this directory.",
                    "Translate 'good morning' into French."]


@dataclass
class CheckReport:
    quant: str
    tokens_identical: bool
    top1_agreement: float
    max_abs_logit_diff: float
    rel_logit_error: float  # max |logit diff| / logit range at the worst position
    greedy_identical: bool  # up to torch's first near-tie
    kl_mean: float = 0.0  # mean KL(torch || llama.cpp) of the next-token distribution, in nats
    decisive_agreement: float = 1.0  # top-1 agreement where torch's top token leads by decisive_margin(quant)
    decisive_positions: int = 0
    positions: int = 0  # every position judged
    median_rel_logit_error: float = 0.0  # max |logit diff| / logit range at the median position
    greedy_compared: int = 0  # greedy tokens compared (each prompt's, up to its first near-tie)
    greedy_tokens: int = 0  # greedy tokens decoded
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how a gate was applied, where not as documented above

    @property
    def passed(self) -> bool:
        return not self.failures

    def describe(self) -> str:
        judged = self.quant in DECISIVE_TOP1_REQUIRED
        close = CLOSENESS_REQUIRED.get(self.quant)
        lines = [f"tokenisation identical: {'yes' if self.tokens_identical else 'NO'}",
                 f"top-1 agreement where torch leads by >= {decisive_margin(self.quant)} logits: "
                 f"{self.decisive_agreement:.1%} of {self.decisive_positions} positions"
                 + (f" (need {DECISIVE_TOP1_REQUIRED[self.quant]:.0%})" if judged else " (reported)"),
                 f"top-1 agreement at all {self.positions} distinct positions: {self.top1_agreement:.1%} "
                 + (f"(judged, at {TOP1_REQUIRED[self.quant]:.0%}, only with fewer than {MIN_DECISIVE} decisive "
                    f"positions)" if self.quant in TOP1_REQUIRED else "(reported)"),
                 f"max |logit difference|: {self.max_abs_logit_diff:.4f}; of the logit range "
                 f"{self.median_rel_logit_error:.3%} at the median position, {self.rel_logit_error:.3%} at the worst"
                 + (f" (need <= {close:.1%} and {WORST_POSITION_FACTOR * close:.1%})" if close else ""),
                 f"mean KL divergence from torch: {self.kl_mean:.5f} nats",
                 f"greedy continuation identical up to torch's first near-tie: "
                 f"{'yes' if self.greedy_identical else 'no'} ({self.greedy_compared} of {self.greedy_tokens} tokens "
                 f"compared)" + (" (required)" if self.quant in GREEDY_REQUIRED else " (reported)"),
                 *(f"note: {n}" for n in self.notes),
                 "validation: " + ("passed" if self.passed else "FAILED: " + "; ".join(self.failures))]
        return "\n".join(lines)


def sample_prompts(tok) -> list[list[int]]:
    """Token ids of a few chat prompts; without a chat template, the raw questions and the sample
    text (the questions alone are too few positions to judge top-1 agreement on)."""
    if not tok.chat_template:
        return [tok(text, add_special_tokens=False)["input_ids"] for text in [*SAMPLE_QUESTIONS, SAMPLE_TEXT]]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in SAMPLE_QUESTIONS]
    return [tok(text, add_special_tokens=False)["input_ids"] for text in texts]


def decisive_margin(quant: str) -> float:
    """The lead (logits) of torch's top token over its runner-up from which a flip in ``quant`` is an error."""
    return DECISIVE_MARGIN if quant in ("f32", "f16", "bf16") else QUANTISED_DECISIVE_MARGIN


def top1_counts(ours: np.ndarray, theirs: np.ndarray, margin: float = DECISIVE_MARGIN) -> tuple[int, int, int]:
    """Of the positions of two [T, V] logit arrays: how many agree on the top token, how many are decisive
    (``ours``' top token leads its runner-up by ``margin`` or more), and how many of those agree."""
    same = theirs.argmax(-1) == ours.argmax(-1)  # [T]
    top2 = np.sort(ours, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= margin  # [T]
    return int(same.sum()), int(clear.sum()), int((same & clear).sum())


def shared_prefix(ids: list[int], earlier: list[list[int]]) -> int:
    """How many of ``ids``' first positions an earlier prompt already judged (same tokens up to there)."""
    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return max((common(ids, e) for e in earlier), default=0)


class TorchReference:
    """The torch side of every check of files written from one model: the sample prompts, their logits, and
    their greedy continuations, decoded once for the checks of an f16 file and of its quantisation, and only as
    far as a check compares them (to torch's first near-tie). The logits are computed again for each check:
    held for every prompt they would be eight [T, V] float arrays (some 240 MB for 50-token prompts at Qwen2.5's
    151,936-token vocabulary), kept through quantisation."""

    def __init__(self, model, tok, greedy_tokens: int = 12):
        model.eval()
        self.model, self.greedy_tokens = model, greedy_tokens
        self.prompts = sample_prompts(tok)
        self.sample_ids = tok(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
        self._greedy: dict[int, tuple[list[int], list[float]]] = {}

    def logits(self, i: int) -> np.ndarray:
        """Prompt ``i``'s next-token logits at every position, [T, V]."""
        with torch.no_grad():
            return self.model(torch.tensor([self.prompts[i]])).logits[0].float().numpy()

    def greedy_until_tie(self, i: int, tie: float) -> list[int]:
        """Prompt ``i``'s greedy tokens before the first whose lead over the runner-up is under ``tie`` (at most
        ``greedy_tokens``): after it, either engine's choice is right and the continuations part."""
        out, leads = self._greedy.get(i, ([], []))
        if before_near_tie(leads, tie) == len(leads) < self.greedy_tokens:  # decoded too short for this tie
            out, leads = self._decode(self.prompts[i], tie)
            self._greedy[i] = out, leads
        return out[:before_near_tie(leads, tie)]

    def _decode(self, ids: list[int], tie: float) -> tuple[list[int], list[float]]:
        """Greedy tokens and the lead of each over the runner-up, up to and including the first near-tie, decoded
        from a key/value cache as llama.cpp decodes: one token's forward a step, not the whole sequence again
        (which made validating a real-size export take hours)."""
        from transformers import DynamicCache

        cache, out, leads = DynamicCache(), [], []
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
            while len(out) < self.greedy_tokens:
                top2 = logits.float().topk(2).values
                out.append(int(logits.argmax()))
                leads.append(float(top2[0] - top2[1]))
                if leads[-1] < tie or len(out) == self.greedy_tokens:
                    break
                logits = self.model(input_ids=torch.tensor([out[-1:]]), cache=cache, use_cache=True).logits[0, -1]
        return out, leads


def _llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    out = []
    if n:
        llm.reset()
        llm.eval(ids)
    for i in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        if i < n - 1:
            llm.eval(out[-1:])
    return out


def before_near_tie(leads: list[float], tie: float) -> int:
    """How many greedy steps come before the first whose lead is under ``tie`` (there, either engine's choice
    is right, and after it the continuations part)."""
    return next((i for i, lead in enumerate(leads) if lead < tie), len(leads))


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) for each row, in nats."""  # [T, V] -> [T]
    log_p = torch.log_softmax(torch.from_numpy(p_logits).double(), -1)
    log_q = torch.log_softmax(torch.from_numpy(q_logits).double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).numpy()


def check_gguf(path: Path, reference: TorchReference, quant: str) -> CheckReport:
    """Compare the GGUF at ``path`` with the torch model of ``reference`` (full precision)."""
    from localrl.quant.runtime import require_llama_cpp

    Llama = require_llama_cpp("validating a GGUF (--no-check skips it)").Llama

    prompts, greedy_tokens = reference.prompts, reference.greedy_tokens
    n_ctx = max(len(p) for p in prompts) + greedy_tokens + 8
    llm = Llama(model_path=str(path), n_ctx=max(n_ctx, 64), logits_all=True, verbose=False, n_threads=2, seed=0)
    try:
        tokens_identical = llm.tokenize(SAMPLE_TEXT.encode(), add_bos=False, special=True) == reference.sample_ids
        agree, total, max_diff, greedy_identical, kl_sum = 0, 0, 0.0, True, 0.0
        decisive, decisive_agree, compared, rel_errors = 0, 0, 0, []
        for i, ids in enumerate(prompts):
            llm.reset()
            llm.eval(ids)
            theirs = np.asarray(llm.scores[:len(ids)], dtype=np.float32)  # [T, V]
            ours = reference.logits(i)
            diff = np.abs(theirs - ours).max(-1)  # [T]
            fresh = slice(shared_prefix(ids, prompts[:i]), None)  # each distinct context judged once
            counts = top1_counts(ours[fresh], theirs[fresh], decisive_margin(quant))
            agree, decisive, decisive_agree = agree + counts[0], decisive + counts[1], decisive_agree + counts[2]
            kl_sum += float(_kl(ours[fresh], theirs[fresh]).sum())
            total += len(ids[fresh])
            max_diff = max(max_diff, float(diff.max()))
            rel_errors.append((diff / (ours.max(-1) - ours.min(-1)))[fresh])
            expected = reference.greedy_until_tie(i, min(decisive_margin(quant), 2 * float(diff.max())))
            compared += len(expected)
            greedy_identical &= _llama_greedy(llm, ids, len(expected)) == expected
    finally:
        llm.close()
    rel_errors = np.concatenate(rel_errors)
    return judge(CheckReport(quant, tokens_identical, agree / total, max_diff, float(rel_errors.max()),
                             greedy_identical, kl_sum / total, decisive_agree / decisive if decisive else 1.0,
                             decisive, total, float(np.median(rel_errors)), compared,
                             greedy_tokens * len(prompts)))


def judge(report: CheckReport) -> CheckReport:
    """Fill ``report.failures`` from its figures by the thresholds above, and ``report.notes`` where a gate
    could not be applied as documented (too few decisive positions)."""
    quant = report.quant
    if not report.tokens_identical:
        report.failures.append("tokenisation differs")
    if quant in DECISIVE_TOP1_REQUIRED:
        if report.decisive_positions >= MIN_DECISIVE:
            if report.decisive_agreement < DECISIVE_TOP1_REQUIRED[quant]:
                report.failures.append(f"top-1 agreement at decisive positions {report.decisive_agreement:.1%} < "
                                       f"{DECISIVE_TOP1_REQUIRED[quant]:.0%}")
        else:  # too few to measure 99% on: every one of them must agree, and a floor over all positions
            floor = (f"{TOP1_REQUIRED[quant]:.0%} top-1 agreement over all {report.positions} positions"
                     if quant in TOP1_REQUIRED else f"its logits within {UNDECIDED_CLOSENESS[quant]:.0%} of their "
                     f"range at the median position")
            report.notes.append(f"only {report.decisive_positions} decisive positions (fewer than {MIN_DECISIVE}): "
                                f"{quant} needs all of them to agree and {floor}")
            if report.decisive_agreement < 1:
                report.failures.append(f"top-1 agreement at decisive positions {report.decisive_agreement:.1%} "
                                       f"of {report.decisive_positions} < 100%")
            if quant in TOP1_REQUIRED and report.top1_agreement < TOP1_REQUIRED[quant]:
                report.failures.append(f"top-1 agreement {report.top1_agreement:.1%} < "
                                       f"{TOP1_REQUIRED[quant]:.0%} (fewer than {MIN_DECISIVE} decisive "
                                       f"positions: judged on all)")
            if quant in UNDECIDED_CLOSENESS and report.median_rel_logit_error > UNDECIDED_CLOSENESS[quant]:
                report.failures.append(f"logits differ by {report.median_rel_logit_error:.1%} of their range at the "
                                       f"median position (fewer than {MIN_DECISIVE} decisive positions)")
    close = CLOSENESS_REQUIRED.get(quant)
    if close is not None and report.median_rel_logit_error > close:
        report.failures.append(f"logits differ by {report.median_rel_logit_error:.2%} of their range at the median "
                               f"position")
    if close is not None and report.rel_logit_error > WORST_POSITION_FACTOR * close:
        report.failures.append(f"logits differ by {report.rel_logit_error:.2%} of their range at the worst position")
    if quant in GREEDY_REQUIRED and not report.greedy_identical:
        report.failures.append("greedy continuation differs before any near-tie")
    return report
