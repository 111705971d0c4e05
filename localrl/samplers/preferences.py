"""Preference pairs as a sampler: nothing is sampled; each step reads ``prompts_per_step`` pairs (``data``: a source
of ``{prompt, chosen, rejected}`` rows in TRL's formats, ``localrl.data.preferences``, or the built-in addition
task's own pairs, or recorded agent sessions' pairs) and hands them over as groups of two, chosen first (reward 1,
rejected 0), for the ``dpo`` objective.

Each completion is the tokens of its text and the end of an assistant turn (as the model would have ended it);
the prompt goes through the chat template, as a sampled prompt would (with the built-in task's system message; a
file's prompts get one only where ``system_prompt`` names it, as TRL adds none). A file's
pairs are walked in seeded per-epoch orders (a step's pairs are a pure function of (seed, step)); its held-out
pairs are ``eval_data``'s, or a seeded tenth of the file (at most ``eval_size``); the built-in task's are its
held-out problems' pairs. The run's evaluations score the held-out pairs (``policy.dpo.preference_accuracy``): the
share the policy's implicit reward ranks right, and the mean margin.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from localrl.agent.session_log import FILE as SESSIONS
from localrl.data import GENERATORS, Task, held_out_split, system_prompt
from localrl.data.preferences import builtin_pair, is_session, preference_row, session_pairs
from localrl.data.sources import Columns, is_missing, raw_rows
from localrl.errors import UserError
from localrl.generation.rollout import Rollout, encode_prompts, left_pad, right_pad
from localrl.policy.dpo import preference_accuracy
from localrl.policy.sft import completion_end
from localrl.samplers import Batch, Measure, ModelInfo, Plan, Sampler, samplers


@samplers.register("preferences")
class Preferences(Sampler):
    about = "preference pairs read from the data, nothing sampled (for objective dpo)"
    measure = Measure("preference accuracy", "pairs", "implicit reward")
    needs = {"takes_pairs": "it hands over fixed pairs"}
    reads = ("preference", "sessions")

    def __init__(self, cfg, rewards=None):
        super().__init__(cfg)
        self.task: Task | None = None
        self.end_id: int | None = None  # the token that ends an assistant turn, known once the model is

    def prepare(self, info: ModelInfo | None, reserve: int = 0) -> Plan:
        cfg = self.cfg
        # the built-in task's pairs are in its answer format, which "auto" states to a real model; a file's pairs are
        # the user's, given as they are (as TRL gives them) unless system_prompt names a message
        builtin = cfg.data in GENERATORS
        system = system_prompt(cfg.system_prompt if builtin or cfg.system_prompt != "auto" else "none", cfg.model)
        self.task = self._load(system)
        if info is None:
            return Plan(0, cfg.max_new_tokens, "none")
        tok, context = info.tok, info.context
        longest_prompt = longest_completion = 0
        pairs = self.task.held_out + (self.task.rows or [])
        if self.task.rows is None:  # generated pairs differ only in digits: the held-out and 64 drawn stand for all
            pairs += [builtin_pair(r) for r in self.task.sample(0, 64, cfg.seed)]
        for where, row in enumerate(pairs):
            prompt = len(encode_prompts(tok, [row], system)[0])
            completion = max(len(tok(row[k], add_special_tokens=False)["input_ids"]) + 1 for k in ("chosen",
                                                                                                   "rejected"))
            if context and prompt + completion > context:
                raise UserError(f"data {cfg.data}: pair {where + 1} is {prompt} prompt and {completion} completion "
                                f"tokens, more than the model's context of {context}", field="data")
            longest_prompt, longest_completion = max(longest_prompt, prompt), max(longest_completion, completion)
        return Plan(longest_prompt, longest_completion, "none", f"pairs: read from {cfg.data} (nothing sampled)")

    def _load(self, system: str | None) -> Task:
        """The training and held-out pairs: a source's rows, or the built-in task's pairs."""
        cfg = self.cfg
        if cfg.data in GENERATORS:
            if cfg.data != "arith":
                raise UserError(f"data {cfg.data}: sampler preferences makes pairs of the built-in arith task only; "
                                f"give a file of {{prompt, chosen, rejected}} rows", field="data")
            held = [builtin_pair({"prompt": p.question}) for p in GENERATORS["arith"].held_out_problems(
                cfg.eval_size)]
            return Task(cfg.data, None, held, system)
        if is_missing(cfg.data):
            raise UserError(f"data {cfg.data!r}: no such file (sampler preferences reads {{prompt, chosen, "
                            f"rejected}} rows)", field="data")
        rows = self._rows(cfg.data, "data")
        if cfg.eval_data:
            return Task(cfg.data, rows, self._rows(cfg.eval_data, "eval_data")[:cfg.eval_size], system)
        held_out, train = held_out_split(rows, cfg.eval_size)
        if not train:
            raise UserError(f"data {cfg.data}: {len(rows)} pairs leave none to train on", field="data")
        return Task(cfg.data, train, held_out, system)

    @staticmethod
    def _rows(source: str, what: str) -> list[dict]:
        """A source's pairs: its rows, or the pairs of the sessions it records (a directory holding a
        ``sessions.jsonl``, as ``localrl agent --record DIR`` writes, or such a file)."""
        if (Path(source) / SESSIONS).is_file():
            source = str(Path(source) / SESSIONS)
        rows, sessions = [], []
        for where, raw in raw_rows(source, Columns(), what):
            if is_session(raw):
                sessions.append((where, raw))
            else:
                rows.append(preference_row(raw, where))
        rows += session_pairs(sessions)
        if not rows:
            why = f" (its {len(sessions)} sessions hold no edit, and no state both approved and rejected)" \
                if sessions else ""
            raise UserError(f"{what} {source}: no preference pairs{why}", field=what)
        return rows

    def start(self, model, tok, budget) -> None:
        self.end_id = completion_end(tok, model)

    @property
    def held_out(self) -> list:
        return self.task.held_out if self.task is not None else []

    def describe_eval(self) -> str:
        return f"on held-out preference pairs ({self.cfg.data})"

    @staticmethod
    def eval_line(r: dict) -> str:
        return (f"preference accuracy {r['accuracy']:.1%} (implicit reward; a tie counts half), mean margin "
                f"{r['reward_mean']:.3f}, the policy's own log-probability prefers the chosen in "
                f"{r['logp_accuracy']:.1%} ({r['n']} held-out pairs)")

    def _pairs(self, tok, rows: list[dict], system: str | None) -> Rollout:
        """``rows``' pairs as a rollout of groups of two, chosen first."""
        prompt_ids, prompt_mask = left_pad(encode_prompts(tok, rows, system), tok.pad_token_id)
        completions = [tok(r[k], add_special_tokens=False)["input_ids"] + [self.end_id]
                       for r in rows for k in ("chosen", "rejected")]
        ids, mask = right_pad(completions, tok.pad_token_id)
        return Rollout(prompt_ids, prompt_mask, ids, mask, torch.zeros(len(completions), dtype=torch.bool), 2)

    def sample(self, ctx, step: int, tokens: int, system=lambda s: s) -> Batch:
        t0 = time.time()
        rows = self.task.sample(step, self.cfg.prompts_per_step, self.cfg.seed)
        if self.task.rows is None:
            rows = [builtin_pair(r) for r in rows]
        rollout = self._pairs(ctx.tok, rows, system(self.task.system))
        lengths = rollout.completion_mask.sum(1).tolist()
        rewards = torch.tensor([1.0, 0.0] * len(rows), dtype=torch.float64)
        return Batch(rollout, rewards, [], [], lengths, 0.0, time.time() - t0, max(lengths), rows=rows)

    def evaluate(self, model, tok, progress=None, batch_size: int = 64, system=lambda s: s, samples: int = 0,
                 stops: list[int] | None = None) -> dict:
        if self.end_id is None:
            self.start(model, tok, None)
        pairs = self._pairs(tok, self.held_out, system(self.task.system))
        out = preference_accuracy(model, pairs, self.cfg, 2 * batch_size)
        if progress is not None:
            progress(out["n"], out["n"])
        return out
