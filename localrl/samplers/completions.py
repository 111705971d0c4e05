"""Prompt completions: ``group_size`` completions of each of a step's prompts, scored by the rewards.

The prompts are a task's rows (a built-in task or the user's data), each given the system message.
Two backends sample them: torch (each group from its own generator, seeded by (seed, step) and the
prompt's index in the global batch, so any number of prompts at a time and any rank gives the same
completions), or llama.cpp (batched, the adapter attached as a GGUF LoRA each step; its log-probs kept
for importance weights). With ``dynamic_sampling`` (DAPO), more prompts are sampled while fewer than
``prompts_per_step`` groups have rewards that differ, and those with a signal are trained first.

Held-out problems are decoded greedily by the same backend, one completion each.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, replace

import torch

from localrl.config import check_fields
from localrl.data import Task, check_reward, load_task, shared_prompts, system_prompt
from localrl.data.monitors import reward_shares
from localrl.data.rewards import combine, config_rewards, overlong_punishment, reward_names, reward_stats, score
from localrl.data.sources import Columns, check_answer_format
from localrl.distributed import world
from localrl.errors import UserError
from localrl.evaluation.evaluate import columns_of, evaluate
from localrl.generation.rollout import (Rollout, completion_token_ids, concat_rollouts, decode_completions,
                                        encode_prompts, group_generators, sample_in_chunks)
from localrl.memory import LLAMA_MAX_SEQUENCES
from localrl.samplers import Batch, ModelInfo, Plan, Sampler, samplers


@samplers.register("completions")
class Completions(Sampler):
    about = "prompt completions, by torch or llama.cpp (the default)"
    needs = {"samples": "it samples completions of the prompts"}
    reads = ("prompt_only",)

    def __init__(self, cfg, rewards=None):
        super().__init__(cfg)
        self._check = check_reward(cfg.check_reward, cfg.data)  # at weight 0: logged, never trained on
        self.reward_fns, self.weights = rewards or config_rewards(cfg, self._check)
        self._check_name = reward_names(self.reward_fns)[-1] if self._check is not None and not rewards else None
        self.task: Task | None = None
        self.backend, self.model_path, self.longest = "torch", "", 0
        self.llama = None  # the LlamaCppRollout, when llama.cpp samples

    @staticmethod
    def check_settings(cfg) -> None:
        check_fields(cfg, [
            ("answer_format", check_answer_format(cfg.answer_format) is None, check_answer_format(cfg.answer_format)),
            *[(name, bool(getattr(cfg, name).strip()), "must name a column") for name in ("prompt_column",
                                                                                         "answer_column")],
            ("data_split", bool(cfg.data_split.strip()), "must name a split (train, for most datasets)"),
            ("dynamic_sampling_rounds", cfg.dynamic_sampling_rounds >= 1, "must be at least 1"),
            ("dynamic_sampling", not (cfg.dynamic_sampling and cfg.env), "applies to prompts, not env episodes"),
        ])

    def check(self, w) -> None:
        if w.distributed and self.cfg.rollout == "llama.cpp":
            raise UserError(f"config field rollout: under torchrun ({w.size} ranks) each rank samples with torch "
                            f"(rollout = auto or torch)", field="rollout")

    # -- before weights load ---------------------------------------------------------------------------------

    def prepare(self, info: ModelInfo | None, reserve: int = 0) -> Plan:
        cfg = self.cfg
        system = system_prompt(cfg.system_prompt, cfg.model, cfg.calibration_weight > 0)
        if info is None:
            self.task = load_task(cfg.data, cfg.eval_data, cfg.eval_size, system=system, columns=Columns.of(cfg))
            return Plan(0, cfg.max_new_tokens)
        tok, context = info.tok, info.context
        widest_token = max(map(len, tok.get_vocab()), default=1)  # characters one token can cover, at most

        def fits(row: dict, where: str) -> None:
            room = context - cfg.max_new_tokens - reserve if context else None
            prompt = row["prompt"]
            chars = (len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)) + \
                len(system or "")
            at_least = chars // widest_token  # a bound that needs no tokenising (a 10 MB line takes half a minute)
            bounded = room is not None and at_least > room
            n = at_least if bounded else len(encode_prompts(tok, [row], system)[0])
            self.longest = max(self.longest, n + reserve)
            if room is not None and n > room:
                also = f" and the objective's {reserve} (experience_tokens)" if reserve else ""
                raise UserError(f"{where}: the prompt is {'at least ' if bounded else ''}{n} tokens; with "
                                f"max_new_tokens {cfg.max_new_tokens}{also} it does not fit the model's context of "
                                f"{context} tokens (shorten it or lower max_new_tokens)", field="data")

        self.task = load_task(cfg.data, cfg.eval_data, cfg.eval_size, fits, system, Columns.of(cfg))
        self._probe_rewards((self.task.held_out or self.task.sample(0, 2, cfg.seed))[:2])
        self.backend, why = self.choose_backend(info)
        if shared := shared_prompts(self.task):
            why += (f"; note: {shared} of the {len(self.task.held_out)} held-out rows "
                    f"({cfg.eval_data or 'split ' + cfg.eval_split}) have a training row's prompt")
        self.model_path = info.path
        extra = 0
        if self.backend == "llama.cpp":  # llama.cpp's copy of the weights and its context live in this process
            from localrl.memory import ModelShape, llama_bytes

            extra = llama_bytes(ModelShape.from_config(info.config), cfg.prompts_per_step * cfg.group_size,
                                self.longest + cfg.max_new_tokens)
        return Plan(self.longest, cfg.max_new_tokens, self.backend, why, extra)

    def _probe_rewards(self, rows: list[dict]) -> None:
        """Call the configured rewards once on made-up completions of ``rows`` (their own answers), so that a
        reward that fails, returns the wrong number of scores or a non-number stops the run before it starts."""
        completions = [f"<think>{r['answer']}</think><answer>{r['answer']}</answer>" for r in rows]
        reward_fns, _ = config_rewards(self.cfg, self._check)
        score(reward_fns, completions, {**columns_of(rows), "completion_ids": [[0]] * len(rows)})

    def choose_backend(self, info: ModelInfo) -> tuple[str, str]:
        """Who samples the completions ("torch" or "llama.cpp"), and why in words. "auto": llama.cpp on a CPU
        (batched decoding, measured 1.9-2.7x torch's full-precision sampler by `localrl bench rollout`) when
        llama-cpp-python is installed and the model can be written as GGUF; torch otherwise, and on each rank
        of a distributed run."""
        cfg = self.cfg
        if cfg.rollout == "torch":
            return "torch", "rollouts: torch (rollout = torch)"
        if world().distributed:
            return "torch", f"rollouts: torch on each of {world().size} ranks (torchrun)"
        from localrl.quant.export import check_exportable

        installed = importlib.util.find_spec("llama_cpp") is not None
        try:
            check_exportable(info.config, info.tok)
            problem = None
        except UserError as e:
            problem = str(e)
        if problem is None and cfg.group_size > LLAMA_MAX_SEQUENCES:  # (a group is sampled in one context)
            problem = (f"a group of {cfg.group_size} completions is more than the {LLAMA_MAX_SEQUENCES} sequences "
                       f"it samples at once; lower group_size")
        if cfg.rollout == "llama.cpp":
            if not installed:
                raise UserError("config field rollout: llama.cpp needs llama-cpp-python (pip install "
                                "'localrl[llama]')", field="rollout")
            if problem:
                raise UserError(f"config field rollout: llama.cpp cannot take this run ({problem})",
                                field="rollout")
            return "llama.cpp", "rollouts: llama.cpp, batched (rollout = llama.cpp)"
        if info.device.type == "cuda" or cfg.unsloth:
            return "torch", "rollouts: torch, on the GPU"
        if not installed:
            return "torch", "rollouts: torch (pip install 'localrl[llama]' for llama.cpp's faster batched rollouts)"
        if problem:
            return "torch", f"rollouts: torch (llama.cpp cannot take this run: {problem})"
        return "llama.cpp", "rollouts: llama.cpp, batched, the adapter attached as a GGUF LoRA each step (a CPU)"

    @property
    def held_out(self) -> list:
        return self.task.held_out if self.task is not None else []

    @property
    def check_name(self) -> str | None:
        return self._check_name

    def describe_eval(self) -> str:
        return f"on single-turn prompts ({self.cfg.data})"

    def require_held_out(self) -> None:
        if not self.held_out:
            raise UserError(f"data {self.cfg.data}: no held-out rows to evaluate on (eval_size is "
                            f"{self.cfg.eval_size}; pass --eval-size N)", field="eval_size")

    # -- a run -------------------------------------------------------------------------------------------------

    def start(self, model, tok, budget) -> None:
        if self.backend == "llama.cpp":
            from localrl.generation.llama_rollout import LlamaCppRollout

            self.llama = LlamaCppRollout(self.model_path, tok, self.cfg.prompts_per_step * self.cfg.group_size,
                                         self.longest + self.cfg.max_new_tokens, log=lambda *_: None, model=model)

    def close(self) -> None:
        if self.llama is not None:
            self.llama.close()
            self.llama = None

    def _overlong_budget(self, tokens: int) -> None:
        """The soft overlong punishment measured against ``tokens``, the completion budget."""
        for fn in self.reward_fns:
            if isinstance(fn, overlong_punishment):
                fn.max_len = tokens

    def sample(self, ctx, step: int, tokens: int, system=lambda s: s) -> Batch:
        """The groups of ``step``'s rows (this rank's share of the global batch), scored; with
        ``dynamic_sampling``, more rows while fewer than ``prompts_per_step`` groups differ."""
        cfg, w, model, tok = self.cfg, ctx.world, ctx.model, ctx.tok
        reward_stats(self.reward_fns)  # (a judge's counts start from this step: an evaluation's are not its)
        self._overlong_budget(tokens)
        t0 = time.time()
        seed = cfg.seed * 1_000_003 + step
        model.eval()
        task = _with_system(self.task, system(self.task.system))
        share = w.shard(cfg.prompts_per_step)  # this rank's prompts of the global batch, and their indices
        rows = task.sample(step, cfg.prompts_per_step * w.size, cfg.seed)[share]
        rounds = [self._round(ctx, task, rows, tokens, seed, share)]
        while cfg.dynamic_sampling and len(rounds) <= cfg.dynamic_sampling_rounds and \
                sum(informative for r in rounds for informative in r.informative(self.weights)) < cfg.prompts_per_step:
            more = task.resample(step, len(rounds), cfg.prompts_per_step * w.size, cfg.seed)[share]
            rounds.append(self._round(ctx, task, more, tokens, seed + len(rounds), share))
        t_gen = time.time() - t0
        rollout = concat_rollouts([r.rollout for r in rounds], tok.pad_token_id)
        scores = [sum((r.scores[i] for r in rounds), []) for i in range(len(self.reward_fns))]
        rewards = torch.tensor(combine(scores, self.weights), dtype=torch.float64)  # [all sampled rows]
        sampler_logp = _cat_right([r.sampler_logp for r in rounds]) if self.llama is not None else None
        sampled_prompts = rollout.prompt_ids.size(0)
        train_rollout, train_rewards = rollout, None
        if len(rounds) > 1:  # train on prompts_per_step groups: those with a signal first, in order
            flags = torch.tensor([f for r in rounds for f in r.informative(self.weights)])
            order = sorted(range(sampled_prompts), key=lambda b: not flags[b])[:cfg.prompts_per_step]
            keep = torch.zeros(sampled_prompts, dtype=torch.bool)
            keep[order] = True
            rows_kept = keep.repeat_interleave(cfg.group_size)
            train_rollout, train_rewards = rollout.groups(keep), rewards[rows_kept]
            if sampler_logp is not None:
                sampler_logp = sampler_logp[rows_kept, :train_rollout.completion_ids.size(1)]
        return Batch(train_rollout, rewards, scores, reward_names(self.reward_fns),
                     rollout.completion_mask.sum(1).tolist(), rollout.truncated.float().mean().item(), t_gen,
                     tokens, train_rewards, sampler_logp, rows=sum((r.rows for r in rounds), []),
                     texts=sum((r.texts for r in rounds), []),
                     extra={"sampled_prompts": sampled_prompts} if cfg.dynamic_sampling else {})

    def _round(self, ctx, task: Task, rows: list[dict], tokens: int, seed: int, share: slice) -> "_Round":
        """Sample and score the groups of ``rows`` (the ``share`` of the round's global batch); each group draws
        from its own generator, seeded by (``seed``, its global index), whichever rank samples it, so sampling
        as many prompts at a time as the memory budget holds gives the same completions."""
        cfg, tok = self.cfg, ctx.tok
        prompts = encode_prompts(tok, rows, task.system)
        rollout, sampler_logp = self.complete(ctx, prompts, cfg.group_size, tokens, seed, share.start)
        columns = {**columns_of(rows, cfg.group_size), "completion_ids": completion_token_ids(rollout)}
        texts = decode_completions(tok, rollout)
        return _Round(rollout, sampler_logp, score(self.reward_fns, texts, columns), texts, rows)

    def complete(self, ctx, prompts: list[list[int]], group: int, tokens: int, seed: int, first: int = 0
                 ) -> tuple[Rollout, torch.Tensor | None]:
        """``group`` completions of up to ``tokens`` tokens of each of ``prompts`` (token ids), by this run's backend,
        and llama.cpp's log-probabilities of them (None where torch samples). Torch draws each prompt's group from its
        own generator, seeded by (``seed``, ``first`` + the prompt's index), so as many prompts at a time as the memory
        budget holds give the same completions."""
        cfg, model, tok = self.cfg, ctx.model, ctx.tok
        if self.llama is not None:
            return self.llama.sample(model, prompts, group, tokens, ctx.stops, tok.pad_token_id, cfg.temperature,
                                     seed, cfg.lora_alpha)
        generators = group_generators(seed, range(first, first + len(prompts)), ctx.device)
        at_once = len(prompts) if ctx.budget is None else ctx.budget.rollout_prompts(
            len(prompts), group, max(map(len, prompts)), tokens)
        return sample_in_chunks(model, prompts, group, tokens, ctx.stops, tok.pad_token_id, cfg.temperature,
                                generators, at_once), None

    def after_step(self, record: dict) -> None:
        record["reward_shares"] = reward_shares(record["rewards"], dict(zip(reward_names(self.reward_fns),
                                                                            self.weights)))
        record.update(reward_stats(self.reward_fns))  # a judge's requests, failures, retries, cached replies

    # -- evaluation --------------------------------------------------------------------------------------------

    def scored_rewards(self) -> tuple[list, list[float]]:
        """The rewards an evaluation scores with: those trained on (the check reward is the monitor's, at weight
        0: it moves neither accuracy nor the mean reward)."""
        if self._check_name is None:
            return self.reward_fns, self.weights
        return self.reward_fns[:-1], self.weights[:-1]

    def generate(self, model, tok, stops: list[int]):
        """Who decodes held-out prompts greedily: llama.cpp when it samples the rollouts, else None (torch's
        greedy completions); another sampler of prompts decodes its own way (Markovian traces)."""
        if self.llama is None:
            return None
        return lambda prompts: self.llama.sample(model, prompts, 1, self.cfg.max_new_tokens, stops,
                                                 tok.pad_token_id, 0.0, 0, self.cfg.lora_alpha)[0]

    def evaluate(self, model, tok, progress=None, batch_size: int = 64, system=lambda s: s, samples: int = 0,
                 stops: list[int] | None = None) -> dict:
        from localrl.generation.rollout import stop_token_ids

        self._overlong_budget(self.cfg.max_new_tokens)  # the held-out evaluation decodes up to max_new_tokens
        stops = stops if stops is not None else stop_token_ids(tok, model)
        if self.llama is not None:
            batch_size = min(batch_size, self.llama.sampler.max_rows)
        fns, weights = self.scored_rewards()
        return evaluate(model, tok, self.task.held_out, fns, weights, self.cfg.max_new_tokens,
                        batch_size, progress=progress, system=system(self.task.system), samples=samples,
                        generate=self.generate(model, tok, stops))


def _with_system(task: Task, system: str | None) -> Task:
    return task if system == task.system else replace(task, system=system)


@dataclass
class _Round:
    """One round of a step's sampling: its rollout, the sampler's log-probabilities and the scores."""

    rollout: Rollout
    sampler_logp: torch.Tensor | None
    scores: list[list[float]]  # per reward function, per completion
    texts: list[str]  # the decoded completions
    rows: list[dict]

    def informative(self, weights: list[float]) -> list[bool]:
        """Per prompt: whether its group's combined rewards differ (a learning signal)."""
        g = self.rollout.group_size
        rewards = combine(self.scores, weights)
        return [len(set(rewards[b * g:(b + 1) * g])) > 1 for b in range(len(rewards) // g)]


def _cat_right(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[N_i, R_i] tensors as one [sum N_i, max R_i], zero-padded on the right."""
    width = max(t.size(1) for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.size(1))) for t in tensors])
