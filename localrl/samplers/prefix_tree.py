"""Tree-OPO's prefix trees (``sampler = prefix_tree``): the student completes prefixes of a teacher's solutions.

Each of a step's prompts has a teacher's worked solution (a trace: the built-in solver's for the addition task, or
a JSONL file of ``{prompt, trace}`` lines). The trace's steps are its lines, the last one (the answer) excluded, and
``tree_prefixes`` prefixes are cut from it at evenly spaced steps: step 0 (the bare prompt), then deeper. Each
prefix is completed ``group_size`` times by the policy, and the rewards score the whole solution, prefix and
completion together. Advantages respect the tree (``localrl.policy.credit.tree_advantages``, the
``tree_baseline`` heuristic): a completion is compared with what its prefix is worth, not with the mean of
completions that started closer to the answer.

The forward computes each prompt's trunk (the prompt and its deepest prefix) once and lets every row branch off it
at its prefix's end (``Rollout.branch``; ``localrl.policy.shared_prompt``): the prefixes are context, never
trained on; the loss covers the student's own tokens. Held-out problems are decoded from the bare prompt, as
prompt completions are, so the figures compare with any other run's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from localrl.config import check_fields, setting
from localrl.data.arithmetic import parse_question, worked_answer
from localrl.data.jsonl import check_prompt, json_objects, last_message
from localrl.data.rewards import combine, reward_names, reward_stats, score
from localrl.errors import UserError
from localrl.evaluation.evaluate import columns_of
from localrl.generation.rollout import Rollout, completion_token_ids, decode_completions, encode_prompts, left_pad
from localrl.policy.credit import TREE_BASELINES, tree_advantages
from localrl.samplers import Batch, ModelInfo, Plan, samplers
from localrl.samplers.completions import Completions, _with_system


def trace_steps(trace: str) -> list[str]:
    """A trace's steps a prefix may end after: its lines, each with its newline, the last line (the answer) never."""
    lines = trace.split("\n")
    return [line + "\n" for line in lines[:-1]]


def cut_depths(steps: int, prefixes: int) -> list[int]:
    """How many steps each of ``prefixes`` prefixes of a ``steps``-step trace keeps: evenly spaced from 0."""
    return [i * steps // prefixes for i in range(prefixes)]


@dataclass
class Tree:
    """One prompt's tree: the trunk's tokens (the prompt, then the deepest prefix), where each prefix ends in it,
    and each prefix's text (what the rewards see before the completion)."""

    trunk: list[int]
    ends: list[int]  # tokens of the trunk each prefix keeps
    depths: list[int]  # steps of the trace each prefix keeps
    texts: list[str]


def make_tree(tok, prompt: list[int], trace: str, prefixes: int) -> Tree:
    """``prompt``'s tree from the teacher's ``trace``, cut into ``prefixes`` prefixes; steps are tokenised one at a
    time, so a prefix's end is a token boundary."""
    steps = trace_steps(trace)
    depths = cut_depths(len(steps), prefixes)
    tokens = [tok(step, add_special_tokens=False)["input_ids"] for step in steps[:max(depths)]]
    trunk, ends = list(prompt), []
    for d in depths:
        ends.append(len(prompt) + sum(map(len, tokens[:d])))
    trunk += [t for step in tokens for t in step]
    return Tree(trunk, ends, depths, ["".join(steps[:d]) for d in depths])


def builtin_trace(row: dict) -> str:
    """The built-in solver's worked solution of an addition problem (its carries all kept)."""
    problem = parse_question(last_message(row["prompt"]))
    if problem is None:
        raise UserError(f"teacher_traces: the built-in solver solves the addition task's questions, not "
                        f"{row['prompt']!r}", field="teacher_traces")
    return worked_answer(problem)


def read_traces(path: str) -> dict[str, str]:
    """{prompt: trace} from a JSONL file of ``{prompt, trace}`` lines (a conversation's prompt: its last message's
    content); the first bad line stops with ``file:line`` and what is wrong."""
    out = {}
    for where, obj in json_objects(path, "teacher_traces"):
        check_prompt(obj.get("prompt"), where)
        trace = obj.get("trace")
        if not isinstance(trace, str) or "\n" not in trace.strip("\n"):
            raise UserError(f"{where}: 'trace' must be a string of steps, one a line (a prefix ends after a line)",
                            field="teacher_traces")
        out[last_message(obj["prompt"])] = trace
    return out


@dataclass
class PrefixTreeSettings:
    """Tree-OPO"""

    teacher_traces: str = setting("", "sampler prefix_tree: the teacher's worked solutions the prefixes are cut from: "
                                      "empty for the built-in solver's (data arith), or a JSONL file of {prompt, "
                                      "trace} lines covering every training prompt")
    tree_prefixes: int = setting(3, "sampler prefix_tree: prefixes cut from each trace, at evenly spaced steps "
                                    "(lines) from the bare prompt on; each is completed group_size times")
    tree_baseline: str = setting("expectation", "sampler prefix_tree: a prefix's value, subtracted from its "
                                                "completions' rewards before the tree's GRPO normalisation: "
                                                "expectation (the mean reward of its subtree), optimistic (its best), "
                                                "pessimistic (its worst)")


@samplers.register("prefix_tree")
class PrefixTree(Completions):
    about = "Tree-OPO: completions of a teacher's solution prefixes"
    settings = PrefixTreeSettings
    needs = {"group_relative": "its advantages are GRPO's, staged over the tree"}

    @staticmethod
    def check_settings(cfg) -> None:
        check_fields(cfg, [
            ("tree_prefixes", 1 <= cfg.tree_prefixes <= 16, "must be from 1 to 16"),
            ("tree_baseline", cfg.tree_baseline in TREE_BASELINES, f"must be one of {', '.join(TREE_BASELINES)}"),
        ])

    @staticmethod
    def check_selected(cfg) -> None:
        check_fields(cfg, [
            ("teacher_traces", bool(cfg.teacher_traces) or cfg.data == "arith",
             "the built-in solver's traces are of the addition task (data arith); give a JSONL of {prompt, trace}"),
            ("sampler", not (cfg.env or cfg.markovian_chunk or cfg.dynamic_sampling),
             "prefix_tree samples prompt completions: not with env, markovian_chunk or dynamic_sampling"),
        ])

    def check(self, w) -> None:
        w.one_process("sampler", "prefix_tree")

    def __init__(self, cfg, rewards=None):
        super().__init__(cfg, rewards)
        self.traces: dict[str, str] | None = None  # the JSONL's; None: the built-in solver's

    def trace(self, row: dict) -> str:
        if self.traces is None:
            return builtin_trace(row)
        found = self.traces.get(last_message(row["prompt"]))
        if found is None:
            raise UserError(f"teacher_traces {self.cfg.teacher_traces}: no trace of the prompt "
                            f"{last_message(row['prompt'])[:80]!r}", field="teacher_traces")
        return found

    def prepare(self, info: ModelInfo | None, reserve: int = 0) -> Plan:
        cfg = self.cfg
        plan = super().prepare(info, reserve)
        if info is None:  # (an evaluation decodes from the bare prompts: no traces)
            return plan
        if cfg.teacher_traces:
            if not Path(cfg.teacher_traces).is_file():
                raise UserError(f"config field teacher_traces: {cfg.teacher_traces}: no such file",
                                field="teacher_traces")
            self.traces = read_traces(cfg.teacher_traces)
        if self.traces is not None and self.task.rows is None:
            raise UserError(f"config field teacher_traces: a file of traces needs data to be a file of the same "
                            f"prompts ({cfg.data}'s problems are generated: the built-in solver's traces are "
                            f"used with empty teacher_traces)", field="teacher_traces")
        # every training prompt needs a trace, and its trunk must fit the context with a completion
        rows = self.task.rows if self.task.rows is not None else [{"prompt": "What is 9999 + 9999?"}]
        longest = max(len(make_tree(info.tok, encode_prompts(info.tok, [r], self.task.system)[0], self.trace(r),
                                    cfg.tree_prefixes).trunk) for r in rows) + reserve
        if info.context and longest + cfg.max_new_tokens > info.context:
            raise UserError(f"teacher_traces: a prompt with its deepest prefix is {longest} tokens; with "
                            f"max_new_tokens {cfg.max_new_tokens} it does not fit the model's context of "
                            f"{info.context} tokens", field="teacher_traces")
        self.longest = max(self.longest, longest)
        rows_per_prompt = cfg.tree_prefixes * cfg.group_size
        extra = plan.extra_bytes
        if self.backend == "llama.cpp":
            from localrl.memory import ModelShape, llama_bytes

            extra = llama_bytes(ModelShape.from_config(info.config),
                                cfg.prompts_per_step * rows_per_prompt,
                                self.longest + cfg.max_new_tokens)
        why = f"{plan.why}; {cfg.tree_prefixes} teacher prefixes a prompt, each completed {cfg.group_size} times"
        return Plan(self.longest, cfg.max_new_tokens, plan.backend, why, extra, rows_per_prompt)

    def start(self, model, tok, budget) -> None:
        if self.backend == "llama.cpp":
            from localrl.generation.llama_rollout import LlamaCppRollout

            rows = self.cfg.prompts_per_step * self.cfg.tree_prefixes * self.cfg.group_size
            self.llama = LlamaCppRollout(self.model_path, tok, rows, self.longest + self.cfg.max_new_tokens,
                                         log=lambda *_: None, model=model)

    def describe_eval(self) -> str:
        return f"on single-turn prompts ({self.cfg.data}), from the bare prompt"

    def sample(self, ctx, step: int, tokens: int, system=lambda s: s) -> Batch:
        """The trees of ``step``'s prompts: every prefix completed ``group_size`` times, scored as whole solutions,
        with the tree's staged advantages."""
        cfg, tok, g, k = self.cfg, ctx.tok, self.cfg.group_size, self.cfg.tree_prefixes
        reward_stats(self.reward_fns)
        self._overlong_budget(tokens)
        t0 = time.time()
        seed = cfg.seed * 1_000_003 + step
        ctx.model.eval()
        task = _with_system(self.task, system(self.task.system))
        rows = task.sample(step, cfg.prompts_per_step, cfg.seed)
        trees = [make_tree(tok, prompt, self.trace(row), k)
                 for row, prompt in zip(rows, encode_prompts(tok, rows, task.system))]
        nodes = [tree.trunk[:end] for tree in trees for end in tree.ends]  # each prefix, a prompt of its group
        sampled, sampler_logp = self.complete(ctx, nodes, g, tokens, seed)
        gen_s = time.time() - t0
        prefixes = [text for tree in trees for text in tree.texts for _ in range(g)]
        texts = [p + c for p, c in zip(prefixes, decode_completions(tok, sampled))]  # the whole solutions
        columns = {**columns_of(rows, k * g), "completion_ids": completion_token_ids(sampled)}
        scores = score(self.reward_fns, texts, columns)
        rewards = torch.tensor(combine(scores, self.weights), dtype=torch.float64)
        trunk_ids, trunk_mask = left_pad([tree.trunk for tree in trees], tok.pad_token_id)
        branch = torch.tensor([end for tree in trees for end in tree.ends]).repeat_interleave(g)
        rollout = Rollout(trunk_ids, trunk_mask, sampled.completion_ids, sampled.completion_mask, sampled.truncated,
                          k * g, branch=branch)
        depths = torch.tensor([tree.depths for tree in trees])
        advantages = tree_advantages(rewards, depths, g, cfg.tree_baseline, cfg.scale_rewards)
        correct = torch.tensor(scores[0]).view(len(trees), k, g).eq(1.0).double()
        by_prefix = {str(i): correct[:, i].mean().item() for i in range(k)}  # accuracy from each prefix index
        return Batch(rollout, rewards, scores, reward_names(self.reward_fns), sampled.completion_mask.sum(1).tolist(),
                     sampled.truncated.float().mean().item(), gen_s, tokens, sampler_logp=sampler_logp,
                     rows=rows, texts=texts, extra={"prefix_accuracy": by_prefix}, advantages=advantages)
