"""PTA-GRPO's plan then act (``sampler = plan_then_act``): plans sampled first, then completions of each plan, and a
plan rewarded for how much it helps.

For each prompt the policy writes ``plan_count`` plans (up to ``plan_tokens`` tokens, ended by ``</plan>``), then
``group_size`` completions of each plan. A completion's reward is the configured rewards of what follows its plan
(the reasoning and the answer; a plan section, where one was written, is not theirs to score) plus ``plan_weight``
x its plan's reward: the share of the ``group_size`` completions after that plan that were right (the first
reward, correctness, at 1). Advantages are GRPO's over all ``plan_count x group_size`` rows of a prompt, so plans
compete with plans and, through the composite reward, a completion after a helpful plan is credited for it. The
plan's tokens are the policy's own: they are trained with the rows that follow them (Dou et al. 2025, "Plan Then
Action", arXiv:2510.01833: an outcome, format and plan reward summed; the paper's exact weights could not be
read here, so the sum is weighted by ``plan_weight``, named as such).

Where the task's system message is the automatic one and the model is not built in, it asks for the plan first.
The built-in models were never taught to write ``<plan>``: there a "plan" is the first ``plan_tokens`` tokens of
the solution, unclosed, and the rewards score the whole text; the records' ``plans_closed`` says which happened.
Held-out problems are decoded in one pass, plan and all, and scored as training scores: after the plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from localrl.config import check_fields, setting
from localrl.data import FORMAT_PROMPT
from localrl.data.rewards import combine, reward_names, reward_stats, score
from localrl.errors import UserError
from localrl.evaluation.evaluate import columns_of
from localrl.generation.rollout import Rollout, decode_completions, encode_prompts
from localrl.models import builtin_path
from localrl.policy.losses import group_advantages
from localrl.samplers import Batch, ModelInfo, Plan, samplers
from localrl.samplers.completions import Completions, _with_system

PLAN_END = "</plan>"
PLAN_PROMPT = ("First write a short plan inside <plan> </plan> tags: the steps you will take, without calculating "
               "anything. Then t" + FORMAT_PROMPT[1:])

def plan_rewards(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """[plans] each plan's reward: the share of its ``group_size`` completions (consecutive in ``correct``, 1 for a
    right one) that were right."""
    return correct.double().view(-1, group_size).mean(dim=1)


def composite_rewards(outcome: torch.Tensor, correct: torch.Tensor, group_size: int, weight: float) -> torch.Tensor:
    """[rows] the outcome rewards plus ``weight`` x the reward of each row's plan."""
    return outcome.double() + weight * plan_rewards(correct, group_size).repeat_interleave(group_size)


def cut_plan(tok, ids: list[int]) -> tuple[list[int], bool]:
    """A sampled plan's tokens up to the one that completes ``</plan>``, and whether one did."""
    text = tok.decode(ids, skip_special_tokens=True)
    if PLAN_END in text:
        for n in range(1, len(ids) + 1):
            if PLAN_END in tok.decode(ids[:n], skip_special_tokens=True):
                return ids[:n], True
    return ids, False


def after_plan(text: str) -> str:
    """What the rewards score: the text after its plan section (a leading ``<plan>...</plan>``), or all of it."""
    head = text.lstrip()
    if head.startswith("<plan>") and PLAN_END in head:
        return head.split(PLAN_END, 1)[1].lstrip()
    return text


class _AfterPlan:
    """A reward that scores what follows each completion's plan section (its name kept)."""

    def __init__(self, fn):
        self.fn, self.__name__ = fn, getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, completions: list[str], **columns) -> list[float]:
        return self.fn([after_plan(c) for c in completions], **columns)


@dataclass
class PlanSettings:
    """PTA-GRPO"""

    plan_count: int = setting(4, "sampler plan_then_act: plans written for each prompt; each is completed group_size "
                                 "times")
    plan_tokens: int = setting(32, "sampler plan_then_act: the longest plan, in tokens (a plan ends at </plan>)")
    plan_weight: float = setting(1.0, "sampler plan_then_act: weight of a plan's reward (the share of its completions "
                                      "that were right) in each of its completions' reward")


@samplers.register("plan_then_act")
class PlanThenAct(Completions):
    about = "PTA-GRPO: plans first, then completions of each plan"
    settings = PlanSettings
    needs = {"group_relative": "its advantages are GRPO's over each prompt's plans"}

    @staticmethod
    def check_settings(cfg) -> None:
        check_fields(cfg, [
            ("plan_count", 2 <= cfg.plan_count <= 16, "must be from 2 to 16 (plans compete with each other)"),
            ("plan_tokens", 1 <= cfg.plan_tokens <= 1024, "must be from 1 to 1024"),
            ("plan_weight", cfg.plan_weight >= 0, "must be at least 0"),
        ])

    @staticmethod
    def check_selected(cfg) -> None:
        check_fields(cfg, [("sampler", not (cfg.env or cfg.markovian_chunk or cfg.dynamic_sampling),
                            "plan_then_act samples prompt completions: not with env, markovian_chunk or "
                            "dynamic_sampling")])

    def check(self, w) -> None:
        w.one_process("sampler", "plan_then_act")

    def prepare(self, info: ModelInfo | None, reserve: int = 0) -> Plan:
        cfg = self.cfg
        plan = super().prepare(info, reserve)
        if cfg.system_prompt == "auto" and builtin_path(cfg.model) is None and self.task.system == FORMAT_PROMPT:
            self.task = _with_system(self.task, PLAN_PROMPT)  # (the longer message: checked against the context below)
        if info is None:
            return plan
        room = self.longest + (len(info.tok(PLAN_PROMPT)["input_ids"]) if self.task.system == PLAN_PROMPT else 0)
        length = cfg.plan_tokens + cfg.max_new_tokens
        if info.context and room + length > info.context:
            raise UserError(f"config field plan_tokens: a prompt of {room} tokens, a plan of {cfg.plan_tokens} and "
                            f"max_new_tokens {cfg.max_new_tokens} do not fit the model's context of {info.context} "
                            f"tokens", field="plan_tokens")
        self.longest = room
        rows_per_prompt = cfg.plan_count * cfg.group_size
        extra = plan.extra_bytes
        if self.backend == "llama.cpp":
            from localrl.memory import ModelShape, llama_bytes

            extra = llama_bytes(ModelShape.from_config(info.config),
                                cfg.prompts_per_step * rows_per_prompt, room + length)
        why = f"{plan.why}; {cfg.plan_count} plans a prompt, each completed {cfg.group_size} times"
        return Plan(room, length, plan.backend, why, extra, rows_per_prompt)

    def start(self, model, tok, budget) -> None:
        if self.backend == "llama.cpp":
            from localrl.generation.llama_rollout import LlamaCppRollout

            rows = self.cfg.prompts_per_step * self.cfg.plan_count * self.cfg.group_size
            self.llama = LlamaCppRollout(self.model_path, tok, rows,
                                         self.longest + self.cfg.plan_tokens + self.cfg.max_new_tokens,
                                         log=lambda *_: None, model=model)

    def describe_eval(self) -> str:
        return f"on single-turn prompts ({self.cfg.data}), plan and reasoning in one pass"

    def scored_rewards(self) -> tuple[list, list[float]]:
        """The held-out evaluation's rewards score what follows the plan, as the training rewards do."""
        fns, weights = super().scored_rewards()
        return [_AfterPlan(fn) for fn in fns], weights

    def sample(self, ctx, step: int, tokens: int, system=lambda s: s) -> Batch:
        """``plan_count`` plans of each of ``step``'s prompts, ``group_size`` completions of each plan, scored by the
        composite reward; the rows are plan and completion together."""
        cfg, tok, g, p = self.cfg, ctx.tok, self.cfg.group_size, self.cfg.plan_count
        reward_stats(self.reward_fns)
        self._overlong_budget(cfg.plan_tokens + tokens)  # (a row is its plan and its completion)
        t0 = time.time()
        seed = cfg.seed * 1_000_003 + step
        ctx.model.eval()
        task = _with_system(self.task, system(self.task.system))
        rows = task.sample(step, cfg.prompts_per_step, cfg.seed)
        prompts = encode_prompts(tok, rows, task.system)
        drafts, draft_logp = self.complete(ctx, prompts, p, cfg.plan_tokens, seed)
        plans, closed = zip(*(cut_plan(tok, ids[mask.bool()].tolist()) for ids, mask in
                              zip(drafts.completion_ids, drafts.completion_mask)))
        plans = [[t for t in plan if t not in ctx.stops] for plan in plans]  # (the completion continues the plan)
        nodes = [prompt + plan for prompt, i in zip(prompts, range(0, len(plans), p)) for plan in plans[i:i + p]]
        acts, act_logp = self.complete(ctx, nodes, g, tokens, seed + 500_009)
        gen_s = time.time() - t0
        # the rows: each plan followed by each of its completions
        act_ids = [ids[mask.bool()].tolist() for ids, mask in zip(acts.completion_ids, acts.completion_mask)]
        whole = [plans[r // g] + ids for r, ids in enumerate(act_ids)]
        width = max(map(len, whole))
        ids = torch.full((len(whole), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, row in enumerate(whole):
            ids[r, :len(row)], mask[r, :len(row)] = torch.tensor(row), 1
        sampler_logp = None
        if draft_logp is not None:
            sampler_logp = torch.zeros(ids.shape, dtype=torch.float32)
            for r, row in enumerate(whole):
                n = len(plans[r // g])
                sampler_logp[r, :n] = draft_logp[r // g, :n]
                sampler_logp[r, n:len(row)] = act_logp[r, :len(row) - n]
        rollout = Rollout(drafts.prompt_ids, drafts.prompt_mask, ids, mask, acts.truncated, p * g)
        texts = decode_completions(tok, rollout)
        scored = [after_plan(t) for t in texts]
        columns = {**columns_of(rows, p * g), "completion_ids": whole}
        scores = score(self.reward_fns, scored, columns)
        outcome = torch.tensor(combine(scores, self.weights), dtype=torch.float64)
        correct = torch.tensor(scores[0]).eq(1.0)
        rewards = composite_rewards(outcome, correct, g, cfg.plan_weight)
        advantages = group_advantages(rewards, p * g, cfg.scale_rewards)
        planned = plan_rewards(correct, g)
        return Batch(rollout, rewards, scores, reward_names(self.reward_fns), mask.sum(1).tolist(),
                     acts.truncated.float().mean().item(), gen_s, cfg.plan_tokens + tokens, sampler_logp=sampler_logp,
                     rows=rows, texts=texts, advantages=advantages,
                     extra={"plan_reward_mean": planned.mean().item(),
                            "plan_reward_spread": (planned.view(-1, p).amax(1) - planned.view(-1, p).amin(1)).mean()
                            .item(),
                            "plans_closed": sum(closed) / len(closed),
                            "plan_len": sum(map(len, plans)) / len(plans)})
