"""Demonstrations as a sampler: nothing is sampled; each step reads ``prompts_per_step`` prompt-completion rows
(``data``: TRL's SFT data, ``localrl.data.demonstrations``) and hands them over, one row a prompt, for an objective
that imitates (``sft``: ``localrl sft --data FILE``).

Each completion is the tokens of its text and the end of an assistant turn (as the model would have ended it); the
prompt goes through the chat template, as a sampled prompt would (a system message only where ``system_prompt``
names one, as TRL adds none). The rows are walked in seeded per-epoch orders (a step's rows are a pure function of
(seed, step)); the held-out rows are ``eval_data``'s, or a seeded tenth of the source (at most ``eval_size``). The
run's evaluations score them teacher-forced, as TRL's SFTTrainer logs its evaluations: the mean token accuracy and
the mean per-token loss (``localrl.policy.sft.demo_scores``).
"""

from __future__ import annotations

import time

import torch

from localrl.data import Task, held_out_split, system_prompt
from localrl.data.demonstrations import read_demonstrations
from localrl.data.sources import is_missing
from localrl.errors import UserError
from localrl.generation.rollout import Rollout, encode_prompts, left_pad, right_pad
from localrl.policy.sft import completion_end, demo_scores
from localrl.samplers import Batch, Measure, ModelInfo, Plan, Sampler, samplers


@samplers.register("demonstrations")
class Demonstrations(Sampler):
    about = "prompt-completion rows read from the data, nothing sampled (for objective sft: localrl sft --data)"
    measure = Measure("token accuracy", "demonstrations", "teacher-forced")
    needs = {"imitates": "it hands over completions to imitate"}
    reads = ("prompt_completion",)

    def __init__(self, cfg, rewards=None):
        super().__init__(cfg)
        self.task: Task | None = None
        self.end_id: int | None = None  # the token that ends an assistant turn, known once the model is

    def prepare(self, info: ModelInfo | None, reserve: int = 0) -> Plan:
        cfg = self.cfg
        if is_missing(cfg.data):
            raise UserError(f"data {cfg.data!r}: no such file (sampler demonstrations reads {{prompt, completion}} "
                            f"rows)", field="data")
        system = system_prompt(cfg.system_prompt if cfg.system_prompt != "auto" else "none", cfg.model)
        rows = read_demonstrations(cfg.data)
        if cfg.eval_data:
            self.task = Task(cfg.data, rows, read_demonstrations(cfg.eval_data, "eval_data")[:cfg.eval_size], system)
        else:
            held_out, train = held_out_split(rows, cfg.eval_size)
            if not train:
                raise UserError(f"data {cfg.data}: {len(rows)} rows leave none to train on", field="data")
            self.task = Task(cfg.data, train, held_out, system)
        if info is None:
            return Plan(0, cfg.max_new_tokens, "none")
        longest_prompt = longest_completion = 0
        for where, row in enumerate(self.task.held_out + self.task.rows):
            prompt = len(encode_prompts(info.tok, [row], system)[0])
            completion = len(info.tok(row["completion"], add_special_tokens=False)["input_ids"]) + 1
            if info.context and prompt + completion > info.context:
                raise UserError(f"data {cfg.data}: row {where + 1} is {prompt} prompt and {completion} completion "
                                f"tokens, more than the model's context of {info.context}", field="data")
            longest_prompt, longest_completion = max(longest_prompt, prompt), max(longest_completion, completion)
        return Plan(longest_prompt, longest_completion, "none", f"demonstrations: read from {cfg.data} (nothing "
                    f"sampled)", rows_per_prompt=1)

    def start(self, model, tok, budget) -> None:
        self.end_id = completion_end(tok, model)

    @property
    def held_out(self) -> list:
        return self.task.held_out if self.task is not None else []

    def describe_eval(self) -> str:
        return f"on held-out demonstrations ({self.cfg.data})"

    @staticmethod
    def eval_line(r: dict) -> str:
        return (f"token accuracy {r['accuracy']:.1%}, mean token loss {r['loss']:.3f} ({r['n']} held-out "
                f"demonstrations, teacher-forced)")

    def _rollout(self, tok, rows: list[dict], system: str | None) -> Rollout:
        prompt_ids, prompt_mask = left_pad(encode_prompts(tok, rows, system), tok.pad_token_id)
        ids, mask = right_pad([tok(r["completion"], add_special_tokens=False)["input_ids"] + [self.end_id]
                               for r in rows], tok.pad_token_id)
        return Rollout(prompt_ids, prompt_mask, ids, mask, torch.zeros(len(rows), dtype=torch.bool), 1)

    def sample(self, ctx, step: int, tokens: int, system=lambda s: s) -> Batch:
        t0 = time.time()
        rows = self.task.sample(step, self.cfg.prompts_per_step, self.cfg.seed)
        rollout = self._rollout(ctx.tok, rows, system(self.task.system))
        lengths = rollout.completion_mask.sum(1).tolist()
        rewards = torch.ones(len(rows), dtype=torch.float64)
        return Batch(rollout, rewards, [], [], lengths, 0.0, time.time() - t0, max(lengths), rows=rows)

    def evaluate(self, model, tok, progress=None, batch_size: int = 32, system=lambda s: s, samples: int = 0,
                 stops: list[int] | None = None) -> dict:
        if self.end_id is None:
            self.start(model, tok, None)
        scores = demo_scores(model, self._rollout(tok, self.held_out, system(self.task.system)), batch_size)
        if progress is not None:
            progress(scores["n"], scores["n"])
        return scores
