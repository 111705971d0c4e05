"""`localrl bench memory`: every phase of a real GRPO step, predicted by the planner and measured.

For each case (a model, its base precision, a budget) a fresh child process plans the run
with ``MemoryBudget`` (as the trainer does) and then runs its phases in the trainer's order: a
GGUF file's one-time conversion (into an empty cache), load (the policy and its optimizer), a
greedy held-out evaluation batch, the rollout (as many prompts at a time as the plan says, each
with its G completions), and the update (reference and policy passes, the planned micro-batches).
Before each phase the process's peak is reset (``bench.PeakMemory``: ``/proc/self/clear_refs`` on
the CPU, ``reset_peak_memory_stats`` on a GPU), so each measured peak is of the whole process
during that phase: resident memory on the CPU, ``torch.cuda.max_memory_allocated`` on a GPU, the
quantities the budget promises.

Models are random-weight models of published shapes (``localrl models shape``), written once
to a cache directory, or any model directory. Random weights rarely sample a stop token, so
every completion runs to its limit, the worst case a budget must survive; the benchmark
checks that they did (a completion that stopped early would make a measurement too kind).
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from localrl.errors import UserError


@dataclass(frozen=True)
class MemoryCase:
    model: str  # a shape name (models/shapes.py) or a model directory / built-in name
    quantize: str = "none"  # "none" or "nf4"
    budget: str = ""  # memory_budget ("": the memory free at start, as a run without one)
    prompts: int = 4
    group: int = 4
    prompt_len: int = 64
    completion_len: int = 32
    eval_batch: int = 16
    compute_dtype: str = "auto"  # what the base computes in (localrl/precision.py)


# Sizes users fine-tune, at budgets that make the planner split (cases beside the default list: --model)
DEFAULT_CASES = (
    MemoryCase("smollm2-135m"),
    MemoryCase("smollm2-135m", budget="1.8GB"),
    MemoryCase("qwen2.5-0.5b", quantize="nf4", budget="2.5GB"),
)


def model_dir(case: MemoryCase, cache: Path, log=print) -> str:
    """The case's model directory: a shape written once into ``cache``, or the model as given."""
    from localrl.models.shapes import SHAPES, write_shape

    if case.model.lower() not in SHAPES:
        return case.model
    out = cache / case.model.lower()
    if not (out / "shape.json").is_file():
        write_shape(case.model, out, log=log)
    return str(out)


_SHORT = {"float32": "f32", "bfloat16": "bf16"}


def bench_memory(cases=DEFAULT_CASES, cache: Path | None = None, device: str = "cpu", log=print) -> list[dict]:
    """One row per case and phase: predicted and measured peak (GiB), their ratio, the budget, seconds."""
    cache = cache or Path.home() / ".cache" / "localrl" / "shapes"
    rows = []
    ctx = multiprocessing.get_context("spawn")  # a fresh process: nothing of this one's heap in the measurement
    log(f"{'model':<16} {'base':<9} {'budget':>7} | {'phase':<10} {'predicted':>9} {'measured':>9} "
        f"{'ratio':>6} {'under':>5} {'s':>7} | plan")
    for case in cases:
        path = model_dir(case, cache, log)
        queue = ctx.Queue()
        child = ctx.Process(target=_measure, args=(path, case, device, queue))
        child.start()
        result = queue.get()
        child.join()
        if isinstance(result, str):
            raise UserError(f"bench memory {case.model}: {result}")
        for r in result["phases"]:
            row = {**asdict(case), **r, "budget_gib": result["budget_gib"], "plan": result["plan"]}
            rows.append(row)
            budget = f"{row['budget_gib']:.2f}" if row["budget_gib"] else "free"
            base = case.quantize + ("" if case.compute_dtype == "auto" else "/" + _SHORT[case.compute_dtype])
            log(f"{case.model:<16} {base:<9} {budget:>7} | {r['phase']:<10} {r['predicted_gib']:>9.2f} "
                f"{r['measured_gib']:>9.2f} {r['ratio']:>6.2f} {'yes' if r['under_budget'] else 'NO':>5} "
                f"{r['seconds']:>7.1f} | {result['plan']}")
    return rows


def _measure(path: str, case: MemoryCase, device_name: str, queue) -> None:
    import os
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as cache:  # a GGUF is converted afresh here, into this cache, measured
            os.environ["XDG_CACHE_HOME"] = cache
            queue.put(_phases(path, case, device_name))
    except UserError as e:
        queue.put(str(e))


def _phases(path: str, case: MemoryCase, device_name: str) -> dict:
    import torch

    from localrl.benchmarks.harness import PeakMemory
    from localrl.config import TrainConfig
    from localrl.generation.rollout import group_generators, sample_groups, sample_in_chunks
    from localrl.heap import return_freed_memory
    from localrl.memory import GIB, MemoryBudget, ModelShape, choose_4bit, conversion_bytes, read_shape
    from localrl.modeling import load_config, load_policy, resolve_model
    from localrl.policy.grpo import update
    from localrl.quant.gguf_import import gguf_path, is_gguf_source

    return_freed_memory()
    device = torch.device(device_name)
    measured, seconds = {}, {}

    def phase(name, fn):  # the whole process's peak during the phase (PeakMemory resets it on entry)
        with PeakMemory(device, rss=True) as mem:
            t0 = time.perf_counter()
            out = fn()
            seconds[name] = time.perf_counter() - t0
        measured[name] = mem.high
        return out

    converting = is_gguf_source(path)
    if converting:  # the one-time conversion, before anything else (its own phase of a first run)
        converted = conversion_bytes(read_shape(path), gguf_path(path).stat().st_size)
        phase("conversion", lambda: resolve_model(path, log=lambda *_: None))
    cfg = TrainConfig(model=path, prompts_per_step=case.prompts, group_size=case.group,
                      max_new_tokens=case.completion_len, quantize=case.quantize, memory_budget=case.budget,
                      eval_batch_size=case.eval_batch, beta=0.04, device=device_name,
                      compute_dtype=case.compute_dtype).validate()
    _, config = load_config(path)
    shape = ModelShape.from_config(config)
    in_4bit, _ = choose_4bit(cfg, shape, case.prompt_len, device)
    budget = MemoryBudget.for_run(cfg, shape, case.prompt_len, device, in_4bit)
    predicted = budget.phases(case.prompt_len, case.completion_len)
    at_once = budget.rollout_prompts(case.prompts, case.group, case.prompt_len, case.completion_len)
    evals = budget.rollout_prompts(case.eval_batch, 1, case.prompt_len, case.completion_len)
    plan = budget.plan(case.prompt_len, case.completion_len)
    if converting:
        predicted = {"conversion": converted, **predicted}

    def load():
        torch.manual_seed(0)
        model, tok = load_policy(cfg, device, in_4bit)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        for p in params:  # the optimizer's state exists from the first step on: make it now
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return model, tok, optimizer

    model, tok, optimizer = phase("load", load)
    g = torch.Generator().manual_seed(0)
    vocab = min(len(tok), shape.vocab)
    prompts = torch.randint(0, vocab, (max(case.prompts, evals), case.prompt_len), generator=g).tolist()
    stops = [tok.eos_token_id] if tok.eos_token_id is not None else []
    model.eval()
    phase("evaluation", lambda: sample_groups(model, prompts[:evals], 1, case.completion_len, stops,
                                              tok.pad_token_id or 0, 0.0))

    sampled = phase("rollout", lambda: sample_in_chunks(
        model, prompts[:case.prompts], case.group, case.completion_len, stops, tok.pad_token_id or 0, 1.0,
        group_generators(1, range(case.prompts), device), at_once))
    lengths = sampled.completion_mask.sum(1)
    if int(lengths.min()) < case.completion_len:
        raise UserError(f"a completion stopped after {int(lengths.min())} of {case.completion_len} tokens: the "
                        f"measurement would be kinder than the worst case (use random weights)")
    rewards = torch.randn(case.prompts * case.group, generator=g).double()  # every group's rewards differ
    phase("update", lambda: update(model, optimizer, sampled, rewards, cfg, 0, budget))
    rows = []
    for name in measured:
        rows.append({"phase": name, "predicted_gib": predicted[name] / GIB, "measured_gib": measured[name] / GIB,
                     "ratio": measured[name] / predicted[name],
                     "under_budget": budget.bytes is None or measured[name] <= budget.bytes,
                     "seconds": seconds[name]})
    described = (f"micro_batch {plan.micro_batch or case.prompts * case.group}, "
                 f"checkpointing {'on' if plan.checkpointing else 'off'}, rollouts {at_once}/{case.prompts} prompts, "
                 f"eval {evals}")
    return {"phases": rows, "budget_gib": (budget.bytes or 0) / GIB if case.budget else 0.0, "plan": described}
