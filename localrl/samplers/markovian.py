"""Markovian traces (Delethink; the chunking itself is ``localrl.generation.markovian``): each completion is reasoned in
chunks of ``markovian_chunk`` tokens whose context is rebuilt at every boundary. Selected by
``markovian_chunk > 0``.

The rewards read each whole trace; the update trains every chunk in the context it was sampled in, with
its trace's advantage (``Batch.reward_rows``), each chunk weighted as one sequence (``dr_grpo``'s constant
is the chunk length). Held-out problems are decoded as greedy traces, chunk by chunk, in training and in
``localrl eval`` alike. The torch sampler only, one process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from localrl.config import check_fields, setting
from localrl.data.rewards import combine, reward_names, reward_stats, score
from localrl.evaluation.evaluate import columns_of
from localrl.generation.markovian import sample_markovian, trace_rollout
from localrl.generation.rollout import Rollout, completion_token_ids, decode_completions, encode_prompts
from localrl.samplers import Batch, ModelInfo, samplers
from localrl.samplers.completions import Completions


@dataclass
class MarkovianSettings:
    """Markovian thinking, Delethink's chunked traces"""

    markovian_chunk: int = setting(0, "Markovian thinking (Delethink): reason in chunks of this many tokens, each "
                                      "sampled from the query plus the last markovian_carry tokens of the one before "
                                      "(0: off; max_new_tokens is then the whole trace's budget)")
    markovian_carry: int = setting(0, "Markovian thinking: tokens of each chunk carried into the next one's context")


@samplers.register("markovian")
class Markovian(Completions):
    about = "Markovian thinking (Delethink): traces in chunks; picked by markovian_chunk"
    settings = MarkovianSettings
    needs = {"samples": "Markovian thinking (markovian_chunk) samples its traces"}

    @classmethod
    def selects(cls, cfg) -> bool:
        return cfg.markovian_chunk > 0

    @staticmethod
    def check_settings(cfg) -> None:
        chunk, carry = cfg.markovian_chunk, cfg.markovian_carry
        check_fields(cfg, [
            ("markovian_chunk", chunk >= 0, "must be non-negative (0: off)"),
            ("markovian_carry", carry == 0 or chunk > 0,
             "needs markovian_chunk (Markovian thinking is off while markovian_chunk is 0)"),
            ("markovian_carry", carry >= 0 and (chunk == 0 or carry < chunk),
             f"must be non-negative and below markovian_chunk ({chunk})"),
            ("markovian_chunk", not (chunk and cfg.env), "Markovian thinking is for single-turn tasks (not env)"),
            ("markovian_chunk", not (chunk and cfg.dynamic_sampling), "does not combine with dynamic_sampling"),
            ("markovian_chunk", not (chunk and cfg.rollout == "llama.cpp"),
             "samples with torch (rollout = auto or torch)"),
        ])

    def check(self, w) -> None:
        w.one_process("markovian_chunk", "Markovian thinking")

    def choose_backend(self, info: ModelInfo) -> tuple[str, str]:
        return "torch", "rollouts: torch (Markovian thinking)"

    def describe_eval(self) -> str:
        return f"on single-turn prompts ({self.cfg.data}), as Markovian traces of {self.cfg.markovian_chunk}-token chunks"

    def sample(self, ctx, step: int, tokens: int, system=lambda s: s) -> Batch:
        """B x G traces in chunks, scored as whole traces; the rows are the chunks, each with its trace's reward."""
        cfg, model, tok = self.cfg, ctx.model, ctx.tok
        reward_stats(self.reward_fns)  # (a judge's counts start from this step)
        self._overlong_budget(tokens)
        t0 = time.time()
        seed = cfg.seed * 1_000_003 + step
        model.eval()
        rows = self.task.sample(step, cfg.prompts_per_step, cfg.seed)
        prompts = encode_prompts(tok, rows, system(self.task.system))
        chunks = sample_markovian(model, prompts, cfg.group_size, cfg.markovian_chunk, cfg.markovian_carry, tokens,
                                  ctx.stops, tok.pad_token_id, cfg.temperature, seed)
        t_gen = time.time() - t0
        whole = trace_rollout(chunks, prompts, cfg.group_size, tok.pad_token_id)
        columns = {**columns_of(rows, cfg.group_size), "completion_ids": completion_token_ids(whole)}
        texts = decode_completions(tok, whole)
        scores = score(self.reward_fns, texts, columns)
        rewards = torch.tensor(combine(scores, self.weights), dtype=torch.float64)  # [B*G]
        rollout = chunks.rollout
        return Batch(rollout, rewards, scores, reward_names(self.reward_fns),
                     [len(t) for t in chunks.traces],  # of whole traces
                     chunks.truncated.float().mean().item(), t_gen, cfg.markovian_chunk,  # (dr_grpo: a chunk)
                     reward_rows=chunks.trace, rows=rows, texts=texts,
                     extra={"chunks_per_trace": rollout.completion_ids.size(0) / len(chunks.traces),
                            "max_context": int((rollout.prompt_mask.sum(1) + rollout.completion_mask.sum(1)).max())})

    def generate(self, model, tok, stops: list[int]):
        """Held-out problems decoded as greedy traces, chunk by chunk, as the rollouts are sampled."""
        cfg = self.cfg

        def traces(prompts: list[list[int]]) -> Rollout:
            chunks = sample_markovian(model, prompts, 1, cfg.markovian_chunk, cfg.markovian_carry, cfg.max_new_tokens,
                                      stops, tok.pad_token_id, 0.0, 0)
            return trace_rollout(chunks, prompts, 1, tok.pad_token_id)

        return traces
