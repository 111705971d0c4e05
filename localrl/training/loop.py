"""The training loop: one ``train()`` for every way localrl trains. It owns the run (its directory, resume,
the held-out evaluations before and after, checkpoints, Ctrl-C, the ranks of a torchrun launch, the
reward-hacking and no-signal monitors, the metrics records) and names no recipe: what a step does is the
configured objective's (``localrl.objectives``), where its rollouts come from and how held-out problems are
decoded is the sampler's the config selects (``localrl.samplers``), and an environment is the sampler's
concern (``localrl.envs``). Each is looked up in a registry by name.

One run:
  preflight (no weights): the config, the objective's and the sampler's checks, the model's files, the data
  against the model's context, the memory plan of every phase -> the run directory -> the model, and a
  checkpoint's state on resume -> evaluation before -> steps: objective.step -> pooled over ranks ->
  objective.after_step -> one metrics record -> a checkpoint every ``save_every`` steps -> evaluation after.
Every random choice is seeded from (seed, step), so a resumed run reproduces an uninterrupted one step for
step. Watchers learn what happens before the first step from ``status`` records: loading the model, then the
held-out evaluation, batch by batch.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from localrl import precision
from localrl.config import TrainConfig
from localrl.data.monitors import FLAT_STEPS_WARNING, HackingMonitor, no_signal_message
from localrl.data.rewards import RewardFn, resolve_rewards
from localrl.distributed import World, init_from_env, pool_records, rank_device, world
from localrl.errors import UserError, first_line
from localrl.generation.rollout import stop_token_ids
from localrl.heap import return_freed_memory
from localrl.memory import MemoryBudget, ModelShape, check_conversion, choose_4bit
from localrl.metrics import Listener, MetricsSink, read_metrics
from localrl.modeling import check_weights, load_config, load_policy, load_tokenizer, pick_device
from localrl.objectives import Objective, StepContext, objective_for
from localrl.runs import Run, adapter_source, base_fingerprint, load_adapter_weights
from localrl.samplers import ModelInfo, Plan, Sampler, sampler_for
from localrl.evaluation.plot import Curve
from localrl.trackers import Reporter, check_report_to
from localrl.training.length_schedule import max_tokens_at
from localrl.training.settings import check_config, read_run_config


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    interrupted: bool
    eval_before: dict | None
    eval_after: dict | None


class _StopFlag:
    """First Ctrl-C asks the loop to stop after the current step (and save); a second one aborts. A second
    SIGINT within ``same_within`` seconds is taken for the first: under torchrun, a rank gets the terminal's
    Ctrl-C and then the same signal passed on by torchrun."""

    def __init__(self, same_within: float = 0.0):
        self.requested = False
        self._previous = None
        self._same_within, self._first = same_within, 0.0

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if not self.requested:
            self.requested, self._first = True, time.monotonic()
        elif time.monotonic() - self._first > self._same_within:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


@dataclass
class Preflight:
    """What a run learned before loading any weights."""

    objective: Objective
    sampler: Sampler  # with its data loaded and checked
    plan: Plan  # the sampler's lengths and backend
    device: torch.device
    budget: MemoryBudget  # of the whole run: memory_budget, or the memory free at start
    in_4bit: bool  # the base in 4-bit NF4 (quantize, with "auto" decided for this machine)
    why_4bit: str  # the choice in words, for the run's first lines
    why_dtype: str  # what the base computes in (compute_dtype, with "auto" decided for this machine), in words
    extra_model_path: str = ""  # another model the objective needs ("": none)

    @property
    def longest_prompt(self) -> int:
        return self.plan.longest_prompt


def preflight(cfg: TrainConfig, resume: bool = False,
              rewards: tuple[list[RewardFn], list[float]] | None = None) -> Preflight:
    """Every check a run makes before any weights load or anything is written: the config, the objective's and
    the sampler's settings (what they refuse under torchrun included), the reward, the model (architecture,
    whole weight files), the adapter to start from (of a new run), the data (every prompt must fit the
    model's context together with max_new_tokens), and the memory of every phase against the budget."""
    check_config(cfg)
    objective = objective_for(cfg)
    sampler = sampler_for(cfg)(cfg, rewards)
    objective.check(world())
    sampler.check(world())
    resolve_rewards(cfg.reward, cfg.reward_weights)
    check_report_to(cfg.report_to)
    device = rank_device(pick_device(cfg.device), world())
    check_conversion(cfg, cfg.model, device)
    path, config = load_config(cfg.model)
    check_weights(path)
    if cfg.init_adapter and not resume:
        adapter_source(cfg, base_fingerprint(cfg.model))
    tok = load_tokenizer(path)
    context = getattr(config, "max_position_embeddings", None)
    if context and cfg.max_new_tokens >= context:
        raise UserError(f"config field max_new_tokens: {cfg.max_new_tokens} leaves no room for a prompt in the "
                        f"model's context of {context} tokens", field="max_new_tokens")
    info = ModelInfo(path, config, tok, context, device)
    plan = sampler.prepare(info, objective.prompt_tokens(info))
    extra_path, extra_phase = objective.preflight(info, sampler, plan)
    shape = ModelShape.from_config(config)
    # the planner's step: the sampler's longest row, the objective's rows per prompt
    group = objective.rows_per_prompt or plan.rows_per_prompt or cfg.group_size
    planned = cfg if (plan.completion_tokens, group) == (cfg.max_new_tokens, cfg.group_size) else \
        replace(cfg, max_new_tokens=plan.completion_tokens, group_size=group)
    decodes = plan.backend == "torch"
    in_4bit, why = choose_4bit(planned, shape, plan.longest_prompt, device, plan.extra_bytes, torch_decodes=decodes,
                               phase=extra_phase)
    budget = MemoryBudget.for_run(planned, shape, plan.longest_prompt, device, in_4bit, plan.extra_bytes,
                                  torch_decodes=decodes, phase=extra_phase)
    why_dtype = precision.resolve(cfg.compute_dtype, device)[1]
    return Preflight(objective, sampler, plan, device, budget, in_4bit, why, why_dtype, extra_path)


def resume_config(run_dir: str | Path, overrides: dict | None = None) -> TrainConfig:
    """The saved config of a run, with ``overrides`` (for example more steps) applied; nothing is written."""
    return read_run_config(Run.open(run_dir, "resume"), overrides)


def _status(stage: str, message: str, **progress) -> dict:
    return {"kind": "status", "stage": stage, "message": message, **progress}


def train(cfg: TrainConfig, rewards: tuple[list[RewardFn], list[float]] | None = None,
          listeners: list[Listener] | tuple = (), resume: bool = False, log=print) -> RunResult:
    """Train as configured; with ``resume``, continue ``cfg.run_dir`` from its last checkpoint. ``rewards``:
    reward functions and weights instead of the configured ones. Launched by torchrun, each rank runs this
    with its own share of every step (distributed.py); rank 0 alone writes the run directory, reports to
    ``listeners`` and logs."""
    return_freed_memory()  # before the first tensor: a fragmented heap would keep several times the live bytes
    w = init_from_env()
    if not w.is_main:
        listeners, log = (), lambda *_: None
    # bad config, data, model or memory stops here, before anything is written (on rank 0 first: a GGUF model
    # is converted once, into the cache the other ranks then read)
    pre = w.rank_0_first(lambda: preflight(cfg, resume, rewards))
    objective, sampler, device = pre.objective, pre.sampler, pre.device
    hacking = HackingMonitor(cfg.hacking_window)
    check_name = sampler.check_name  # the reward the monitor reads (logged at weight 0, never trained on)
    base = base_fingerprint(cfg.model)
    run = _open_run(cfg, base, resume, w, log)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # a new run records from the start; a resumed one only once its checkpoint has loaded, so that a
    # failed resume leaves its directory exactly as it was
    sink = MetricsSink(None if resume or not w.is_main else run.metrics_path, listeners)
    reporter = None
    try:
        sink.emit(_status("load", f"loading {cfg.model} on the {device.type}: {pre.why_4bit}; {pre.why_dtype}; "
                                   f"{pre.plan.why}"))
        for line in pre.budget.describe(pre.longest_prompt, pre.budget.cfg.max_new_tokens):
            log(line)
            if line.startswith("memory: to fit"):  # what the planner changed: in the run's record, for watchers
                sink.emit({"kind": "note", "step": 0, "message": line})
        torch.manual_seed(cfg.seed)
        model, tok = load_policy(cfg, device, pre.in_4bit)
        sampler.start(model, tok, pre.budget)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        if w.is_main:
            run.remove_leftovers()
        w.barrier()  # (rank 0's cleaning done before any rank reads a checkpoint)
        start, history, run_state = 0, [], {}
        if resume:
            start = run.restore(model, optimizer, log, run_state)
        stops = stop_token_ids(tok, model)
        ctx = StepContext(cfg, model, tok, optimizer, sampler, pre.budget, stops, w, run, device,
                          pre.extra_model_path, log)
        objective.setup(ctx, run_state)
        if resume and w.is_main:
            # steps after the checkpoint will be recomputed: drop their records
            history = [r for r in read_metrics(run.metrics_path)
                       if (r.get("kind") in ("train", "checkpoint") and r["step"] <= start)
                       or (r.get("kind") == "eval" and r.get("when") == "before")]
            sink.write_to(run.metrics_path, history)
            for r in history:  # the monitor's window as the uninterrupted run had it
                if r.get("kind") == "train" and check_name is not None:
                    hacking.observe(r["reward_mean"], r["rewards"].get(check_name), r["step"])
        if cfg.init_adapter and start == 0:  # after a checkpoint, the adapter is the one the run had reached
            source = adapter_source(cfg, base)
            load_adapter_weights(model, source)
            log(f"adapter initialised from {source}")
        w.broadcast_parameters(params)  # every rank starts from rank 0's adapter
        if w.is_main:
            run.write_config(cfg, base)  # from here on the run can be resumed
            reporter = Reporter.open(cfg.report_to, run, cfg.to_dict(), start, log,  # --report-to's trackers
                                     Curve(sampler.measure.what, objective.samples))
            if reporter is not None:
                sink.listeners.append(reporter)
        w.barrier()
    except BaseException as e:
        if reporter is not None:
            reporter.close()
        sink.close()
        sampler.close()
        if not resume and w.is_main:
            run.discard()
        run.release()
        if isinstance(e, KeyboardInterrupt):
            log("interrupted before training started: nothing was saved")
        raise

    def evaluation(when: str, step: int) -> dict:
        """Held-out figures through the sampler (as `localrl eval` has them), a status record per batch."""
        def progress(done: int, total: int) -> None:
            sink.emit(_status("eval", f"evaluating {when} training", when=when, done=done, total=total))

        completion_len = pre.budget.cfg.max_new_tokens  # (the planned completion: a whole multi-turn trajectory)
        batch_size = pre.budget.rollout_prompts(cfg.eval_batch_size, 1, pre.longest_prompt, completion_len)
        return {"kind": "eval", "when": when, "step": step,
                **sampler.evaluate(model, tok, progress, batch_size, objective.system, stops=stops)}

    try:
        eval_before = next((r for r in history if r.get("kind") == "eval" and r.get("when") == "before"), None)
        evaluates = bool(cfg.eval_size and sampler.held_out)
        if eval_before is None and evaluates and w.is_main:
            eval_before = evaluation("before", 0)
            sink.emit(eval_before)
        w.barrier()  # (the other ranks wait for rank 0's evaluation)

        interrupted, done, t_run, flat_steps, memory_warned = False, start, time.time(), 0, False
        wall_offset = max((r.get("wall_time", 0.0) for r in history if r.get("kind") == "train"), default=0.0)
        with _StopFlag(same_within=2.0 if w.distributed else 0.0) as stop_flag:
            for step in range(start, cfg.steps):
                tokens = max_tokens_at(cfg, step)  # this step's completion budget (budget_schedule)
                try:
                    record = objective.step(ctx, step, tokens)
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not _is_out_of_memory(e):
                        raise
                    raise UserError(f"step {step + 1}: out of memory ({first_line(e)}); lower group_size, "
                                    f"prompts_per_step or max_new_tokens, or set memory_budget; --resume "
                                    f"{run.path} continues from the last checkpoint") from None
                except UserError as e:
                    if not w.is_main:  # a problem of this rank's share of the step: the CLI names the rank
                        e.rank = w.rank
                    raise
                if w.distributed:
                    record = pool_records(w.gather(record))
                if cfg.budget_schedule != "constant":
                    record["max_new_tokens"] = tokens
                if objective.sample_rewards:  # where the reward comes from
                    sampler.after_step(record)
                objective.after_step(ctx, step, record)
                record["wall_time"] = round(wall_offset + time.time() - t_run, 3)
                sink.emit(record)
                flat_steps = flat_steps + 1 if record.get("frac_reward_zero_std") == 1 else 0
                messages = ([no_signal_message(record, flat_steps, cfg.temperature)]
                            if flat_steps == FLAT_STEPS_WARNING else [])
                if check_name is not None and check_name in record.get("rewards", {}):
                    hacked = hacking.observe(record["reward_mean"], record["rewards"][check_name], step + 1)
                    messages += [("warning", hacked)] if hacked else []
                nearing = None if memory_warned else pre.budget.nearing(record.get("peak_mem_mb"))
                if nearing:  # once a run
                    messages.append(("warning", nearing))
                    memory_warned = True
                for kind, message in messages:
                    sink.emit({"kind": kind, "step": step + 1, "message": message})
                    log(f"warning: {message}" if kind == "warning" else message)
                done = step + 1
                stop = w.any(stop_flag.requested)  # every rank stops after the same step
                if stop or done % cfg.save_every == 0 or done == cfg.steps:
                    if w.is_main:
                        run.save_checkpoint(done, model, optimizer, cfg.keep_checkpoints, objective.state())
                        sink.emit({"kind": "checkpoint", "step": done})
                    w.barrier()
                if stop:
                    interrupted = True
                    log(f"interrupted: saved checkpoint at step {done}; continue with --resume {run.path}")
                    break
        eval_after = None
        if not interrupted and evaluates and w.is_main:
            eval_after = evaluation("after", done)
            sink.emit(eval_after)
        w.barrier()
    finally:
        if reporter is not None:
            reporter.close()
        sink.close()
        sampler.close()
        run.release()
    return RunResult(run.path, done, interrupted, eval_before, eval_after)


def _open_run(cfg: TrainConfig, base: dict, resume: bool, w: World, log) -> Run:
    """The run directory: opened to resume (on every rank, which all load its checkpoint) or made by rank 0,
    whose path (or the one line saying why it cannot be) the other ranks receive."""
    if resume:
        run = Run.open(cfg.run_dir, "resume")
        if w.is_main:
            run.acquire()  # one live process a run: not a second --resume, nor one while it still trains
        try:
            run.check_base(base)
        except BaseException:
            run.release()
            raise
        return run
    if not w.distributed:
        return Run.create(cfg.run_dir or None, log)
    made: tuple[str, str] = ("", "")
    run = None
    if w.is_main:
        try:
            run = Run.create(cfg.run_dir or None, log)  # (kept: it holds the directory's lock)
            made = (str(run.path), "")
        except UserError as e:
            made = ("", str(e))
    path, problem = w.broadcast(made)
    if problem:
        raise UserError(problem)
    return run if run is not None else Run(path)


def _is_out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text
