"""The GRPO training loop: sample groups, score, compute advantages, update the LoRA adapter.

One step:
  rows (pure function of seed, step) -> G completions per prompt (one prefill per prompt)
  -> rewards -> group-relative advantages -> clipped policy loss (+ beta * KL to the base
  model, whose log-probs come from the same network with the adapter switched off)
  -> ``num_iterations`` AdamW updates -> one metrics record -> a checkpoint every N steps.
With beta 0, groups whose completions all scored alike are left out of the update (their gradient
is exactly zero); a step in which every group did updates nothing, rather than replay Adam's momentum.

The training forward computes each prompt once for its group (prompt_cache.py; with
``prompt_cache=False`` it concatenates prompt and completion per row instead). Deliberate
simplifications: on-policy sampling from the current adapter; one device. Every random
choice is seeded from (seed, step), so a resumed run reproduces an uninterrupted one step
for step.

Before anything is written, ``preflight`` checks what can be checked without weights; the
run directory (runs.py) then gets its config only once the model (and on resume, the
checkpoint) has loaded. Watchers learn what happens before the first step from ``status``
records: loading the model, then the held-out evaluation, batch by batch.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from localrl.agent_rollout import TurnFormat, trajectory_budget
from localrl.agent_train import EnvSetup, agent_step, env_setup, evaluate_episodes
from localrl.budget import token_budget
from localrl.config import TrainConfig
from localrl.distributed import World, init_from_env, pool_records, rank_device, world
from localrl.envs.shell import probe_verifiers
from localrl.envs.shell_tasks import load_tasks
from localrl.errors import UserError
from localrl.evaluate import columns_of, evaluate
from localrl.experience import (MAX_LESSON_CHARS, ExperienceLibrary, Judge, check_judge_fits, contrasting_pairs,
                                initial_library, judge_load, judge_request, parse_edits, question_text, reply_start)
from localrl.grpo import EntropyControl, step_record, update
from localrl.heap import return_freed_memory
from localrl.memory import (JudgeLoad, MemoryBudget, ModelShape, check_conversion, choose_4bit, frozen_bytes,
                            llama_bytes)
from localrl.metrics import Listener, MetricsSink, read_metrics
from localrl.monitors import HackingMonitor, reward_shares
from localrl.modeling import (check_weights, default_4bit, load_base, load_config, load_policy, load_tokenizer,
                              pick_device)
from localrl.llama_rollout import LlamaCppRollout
from localrl.markovian import markovian_step, sample_markovian, trace_rollout
from localrl.rewards import (RewardFn, combine, config_rewards, overlong_punishment, resolve_rewards, reward_names,
                             score)
from localrl.rollout import (Rollout, completion_token_ids, concat_rollouts, decode_completions, encode_prompts,
                             group_generators, sample_in_chunks, stop_token_ids)
from localrl.reference import Reference
from localrl.runs import Run, adapter_source, base_fingerprint, load_adapter_weights
from localrl.sft import sft_step
from localrl.tasks import Task, check_reward, load_task, system_prompt


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

    task: Task | None  # the prompts (None when training an agent in an environment)
    device: torch.device
    budget: MemoryBudget  # of the whole run: memory_budget, or the memory free at start
    longest_prompt: int  # tokens, through the chat template
    in_4bit: bool  # the base in 4-bit NF4 (quantize, with "auto" decided for this machine)
    why_4bit: str  # the choice in words, for the run's first lines
    rollout: str  # "torch" or "llama.cpp" (rollout, with "auto" decided)
    why_rollout: str
    model_path: str  # the model's resolved directory
    env: EnvSetup | None = None  # the environment's tasks and sandbox, when training an agent
    context: int = 2048  # the model's context, in tokens
    judge_path: str = ""  # objective experience: the judge's resolved directory ("" : the policy model judges)


def preflight(cfg: TrainConfig, resume: bool = False) -> Preflight:
    """Every check a run makes before any weights load or anything is written: the config, the
    reward, the model (architecture, whole weight files), the adapter to start from (of a new run),
    every prompt (it must fit the model's context together with max_new_tokens), and the memory a
    step needs against what is free."""
    cfg.validate()
    check_distributed(cfg, world())
    resolve_rewards(cfg.reward, cfg.reward_weights)
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
    if cfg.env:
        return _env_preflight(cfg, path, config, tok, context or 2048)
    system = system_prompt(cfg.system_prompt, cfg.model, cfg.calibration_weight > 0)
    longest = 0
    widest_token = max(map(len, tok.get_vocab()), default=1)  # characters one token can cover, at most

    def fits(row: dict, where: str) -> None:
        nonlocal longest
        room = context - cfg.max_new_tokens if context else None
        prompt = row["prompt"]
        chars = (len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)) + len(system or "")
        at_least = chars // widest_token  # a bound that needs no tokenising (a 10 MB line takes half a minute)
        bounded = room is not None and at_least > room
        n = at_least if bounded else len(encode_prompts(tok, [row], system)[0])
        longest = max(longest, n)
        if room is not None and n > room:
            raise UserError(f"{where}: the prompt is {'at least ' if bounded else ''}{n} tokens; with "
                            f"max_new_tokens {cfg.max_new_tokens} it does not fit the model's context of {context} "
                            f"tokens (shorten it or lower max_new_tokens)", field="data")

    task = load_task(cfg.data, cfg.eval_data, cfg.eval_size, fits, system)
    probe_rewards(cfg, (task.held_out or task.sample(0, 2, cfg.seed))[:2])
    shape = ModelShape.from_config(config)
    backend, why_backend = choose_rollout(cfg, device, config, tok)
    # llama.cpp's copy of the weights and its context live in this process all run
    extra = llama_bytes(shape, cfg.prompts_per_step * cfg.group_size, longest + cfg.max_new_tokens) \
        if backend == "llama.cpp" else 0
    judge_path, judge = "", None
    if cfg.objective == "experience":
        try:  # a library to start from must read
            initial_library(cfg.experience_size, cfg.experience_init)
        except UserError as e:
            raise UserError(f"config field experience_init: {e}", field="experience_init") from None
        judge_path, judge = _judge_preflight(cfg, tok, context, device, shape, longest)
    decodes = backend == "torch"
    in_4bit, why = choose_4bit(cfg, shape, longest, device, extra, torch_decodes=decodes, judge=judge)
    budget = MemoryBudget.for_run(cfg, shape, longest, device, in_4bit, extra, torch_decodes=decodes, judge=judge)
    return Preflight(task, device, budget, longest, in_4bit, why, backend, why_backend, path, judge_path=judge_path)


def _judge_preflight(cfg: TrainConfig, tok, context: int | None, device, shape: ModelShape, longest: int
                     ) -> tuple[str, JudgeLoad]:
    """Training-free GRPO's judge: its weights and tokenizer, and a context that holds a request; its resolved
    directory ("" when the policy model judges) and its share of the run's memory."""
    if not cfg.experience_judge:
        check_judge_fits(tok, context, cfg.max_new_tokens, cfg.experience_judge_tokens,
                         f"the policy model {cfg.model} (the judge while experience_judge is empty)")
        return "", judge_load(cfg, tok, context, shape, 0, longest)
    check_conversion(cfg, cfg.experience_judge, device)
    try:
        path, config = load_config(cfg.experience_judge)
    except UserError as e:
        raise UserError(f"config field experience_judge: {e}", field="experience_judge") from None
    check_weights(path)
    judge_tok, judge_context = load_tokenizer(path), getattr(config, "max_position_embeddings", None)
    check_judge_fits(judge_tok, judge_context, cfg.max_new_tokens, cfg.experience_judge_tokens,
                     f"the judge {cfg.experience_judge}")
    judge_shape = ModelShape.from_config(config)
    weights = frozen_bytes(judge_shape, default_4bit(cfg.quantize, device), device)
    return path, judge_load(cfg, judge_tok, judge_context, judge_shape, weights, longest)


def _load_judge(cfg: TrainConfig, pre: Preflight, model, tok) -> Judge:
    """The policy model as its own judge, or the ``experience_judge`` model (frozen, no adapter)."""
    at_once = pre.budget.judge_requests()  # as many requests at a time as the memory budget holds
    if not pre.judge_path:
        return Judge(model, tok, cfg.experience_judge_tokens, getattr(model.config, "max_position_embeddings", None),
                     at_once)
    judge = load_base(pre.judge_path, default_4bit(cfg.quantize, pre.device), pre.device)
    return Judge(judge, load_tokenizer(pre.judge_path), cfg.experience_judge_tokens,
                 getattr(judge.config, "max_position_embeddings", None), at_once)


def probe_rewards(cfg: TrainConfig, rows: list[dict]) -> None:
    """Call the configured rewards once on made-up completions of ``rows`` (their own answers), so that a
    reward that fails, returns the wrong number of scores or a non-number stops the run before it starts."""
    completions = [f"<think>{r['answer']}</think><answer>{r['answer']}</answer>" for r in rows]
    reward_fns, _ = config_rewards(cfg, check_reward(cfg.check_reward, cfg.data))
    score(reward_fns, completions, {**columns_of(rows), "completion_ids": [[0]] * len(rows)})


def _env_preflight(cfg: TrainConfig, path: str, config, tok, context: int) -> Preflight:
    """Preflight of an agent run: the tasks and sandbox, every held-out prompt against the context, and the
    memory of a step whose completions are whole trajectories (up to the context)."""
    env = env_setup(cfg)
    if cfg.env_tasks and not cfg.env_tasks.endswith(".jsonl"):  # a file's checks are data, checked as it loads
        probe_verifiers(cfg.env_tasks, load_tasks(cfg.env_tasks), env.isolation, cfg.env_timeout)
    fmt = TurnFormat(tok, env.system)
    longest = max((len(fmt.prompt_ids(t.instruction)) for t in env.held_out), default=0)
    if longest + cfg.max_new_tokens > context:
        raise UserError(f"config field max_new_tokens: a held-out task's prompt is {longest} tokens; with "
                        f"max_new_tokens {cfg.max_new_tokens} a turn does not fit the model's context of {context} "
                        f"tokens", field="max_new_tokens")
    device = rank_device(pick_device(cfg.device), world())
    shape = ModelShape.from_config(config)
    # the longest trajectory: every turn and tool output at its limit, within the context
    budget_tokens = min(context - longest, trajectory_budget(fmt, cfg.max_turns, cfg.max_new_tokens))
    # a warm-start step has one (expert) trajectory per task; a GRPO step group_size
    trajectory = replace(cfg, max_new_tokens=budget_tokens, group_size=1 if cfg.objective == "sft" else cfg.group_size)
    in_4bit, why = choose_4bit(trajectory, shape, longest, device)
    budget = MemoryBudget.for_run(trajectory, shape, longest, device, in_4bit)
    if cfg.rollout == "llama.cpp":
        raise UserError("config field rollout: multi-turn episodes are sampled by torch (rollout = auto or torch)",
                        field="rollout")
    what = "expert episodes (sft)" if cfg.objective == "sft" else "rollouts: torch, multi-turn episodes"
    return Preflight(None, device, budget, longest, in_4bit, why, "torch",
                     f"{what}; sandbox isolation: {env.isolation}", path, env, context)


def check_distributed(cfg: TrainConfig, w: World) -> None:
    """What a run launched on several ranks (torchrun) cannot do, refused in one line."""
    if not w.distributed:
        return
    if cfg.objective == "sft":
        raise UserError(f"config field objective: sft runs in one process; launch it without torchrun (this "
                        f"launch has {w.size} ranks)", field="objective")
    if cfg.rollout == "llama.cpp":
        raise UserError(f"config field rollout: under torchrun ({w.size} ranks) each rank samples with torch "
                        f"(rollout = auto or torch)", field="rollout")
    if cfg.markovian_chunk:
        raise UserError(f"config field markovian_chunk: Markovian thinking runs in one process; launch it without "
                        f"torchrun (this launch has {w.size} ranks)", field="markovian_chunk")
    if cfg.objective == "experience":
        raise UserError(f"config field objective: experience keeps one library in one process; launch it without "
                        f"torchrun (this launch has {w.size} ranks)", field="objective")


def choose_rollout(cfg: TrainConfig, device: torch.device, config, tok) -> tuple[str, str]:
    """Who samples the completions ("torch" or "llama.cpp"), and why in words. "auto": llama.cpp on a CPU
    (batched decoding, measured 1.9-2.7x torch's full-precision sampler by `localrl bench rollout`) when
    llama-cpp-python is installed and the model can be written as GGUF; torch otherwise, and on each rank
    of a distributed run."""
    if cfg.rollout == "torch":
        return "torch", "rollouts: torch (rollout = torch)"
    if cfg.markovian_chunk:
        return "torch", "rollouts: torch (Markovian thinking)"
    if world().distributed:
        return "torch", f"rollouts: torch on each of {world().size} ranks (torchrun)"
    import importlib.util

    from localrl.quant.export import check_exportable

    installed = importlib.util.find_spec("llama_cpp") is not None
    try:
        check_exportable(config, tok)
        problem = None
    except UserError as e:
        problem = str(e)
    if cfg.rollout == "llama.cpp":
        if not installed:
            raise UserError("config field rollout: llama.cpp needs llama-cpp-python (pip install 'localrl[llama]')",
                            field="rollout")
        if problem:
            raise UserError(f"config field rollout: llama.cpp cannot take this model ({problem})", field="rollout")
        return "llama.cpp", "rollouts: llama.cpp, batched (rollout = llama.cpp)"
    if device.type == "cuda" or cfg.unsloth:
        return "torch", "rollouts: torch, on the GPU"
    if not installed:
        return "torch", "rollouts: torch (pip install 'localrl[llama]' for llama.cpp's faster batched rollouts)"
    if problem:
        return "torch", f"rollouts: torch (llama.cpp cannot take this model: {problem})"
    return "llama.cpp", "rollouts: llama.cpp, batched, the adapter attached as a GGUF LoRA each step (a CPU)"


def resume_config(run_dir: str | Path, overrides: dict | None = None) -> TrainConfig:
    """The saved config of a run, with ``overrides`` (for example more steps) applied; nothing is written."""
    return Run.open(run_dir, "resume").read_config(overrides)


def _status(stage: str, message: str, **progress) -> dict:
    return {"kind": "status", "stage": stage, "message": message, **progress}


def train(cfg: TrainConfig, rewards: tuple[list[RewardFn], list[float]] | None = None,
          listeners: list[Listener] | tuple = (), resume: bool = False, log=print) -> RunResult:
    """Run GRPO as configured; with ``resume``, continue ``cfg.run_dir`` from its last checkpoint. Launched by
    torchrun, each rank runs this with its own share of every step (distributed.py); rank 0 alone writes
    the run directory, reports to ``listeners`` and logs."""
    return_freed_memory()  # before the first tensor: a fragmented heap would keep several times the live bytes
    w = init_from_env()
    if not w.is_main:
        listeners, log = (), lambda *_: None
    # bad config, data, model or memory stops here, before anything is written (on rank 0 first: a GGUF model
    # is converted once, into the cache the other ranks then read)
    pre = w.rank_0_first(lambda: preflight(cfg, resume))
    task, device = pre.task, pre.device
    check = None if cfg.env else check_reward(cfg.check_reward, cfg.data)  # at weight 0: logged, never trained on
    reward_fns, weights = rewards or config_rewards(cfg, check)
    hacking = HackingMonitor(cfg.hacking_window)
    check_name = reward_names(reward_fns)[-1] if check is not None and not rewards else None
    base = base_fingerprint(cfg.model)
    run = _open_run(cfg, base, resume, w, log)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # a new run records from the start; a resumed one only once its checkpoint has loaded, so that a
    # failed resume leaves its directory exactly as it was
    sink = MetricsSink(None if resume or not w.is_main else run.metrics_path, listeners)
    sampler = None  # the llama.cpp rollout backend, when chosen
    try:
        sink.emit(_status("load", f"loading {cfg.model} on the {device.type}: {pre.why_4bit}; {pre.why_rollout}"))
        for line in pre.budget.describe(pre.longest_prompt, pre.budget.cfg.max_new_tokens):
            log(line)
            if line.startswith("memory: to fit"):  # what the planner changed: in the run's record, for watchers
                sink.emit({"kind": "note", "step": 0, "message": line})
        torch.manual_seed(cfg.seed)
        model, tok = load_policy(cfg, device, pre.in_4bit)
        library = initial_library(cfg.experience_size, cfg.experience_init) if cfg.objective == "experience" else None
        judge = _load_judge(cfg, pre, model, tok) if library is not None else None
        if pre.rollout == "llama.cpp":
            sampler = LlamaCppRollout(pre.model_path, tok, cfg.prompts_per_step * cfg.group_size,
                                      pre.longest_prompt + cfg.max_new_tokens, log=lambda *_: None)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        if w.is_main:
            run.remove_leftovers()
        w.barrier()  # (rank 0's cleaning done before any rank reads a checkpoint)
        start, history, run_state = 0, [], {}
        if resume:
            start = run.restore(model, optimizer, log, run_state)
            if library is not None and "experience" in run_state:  # the library the checkpoint's step had
                library = replace(ExperienceLibrary.from_state(run_state["experience"]), capacity=cfg.experience_size)
        reference = Reference(run_state.get("reference"))
        entropy = EntropyControl(run_state.get("entropy_coef", cfg.entropy_coef),
                                 run_state.get("last_entropy", float("inf")))
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
        w.barrier()
    except BaseException as e:
        sink.close()
        if sampler is not None:
            sampler.close()
        if not resume and w.is_main:
            run.discard()
        if isinstance(e, KeyboardInterrupt):
            log("interrupted before training started: nothing was saved")
        raise

    stops = stop_token_ids(tok, model)
    try:
        eval_before = next((r for r in history if r.get("kind") == "eval" and r.get("when") == "before"), None)
        held_out = pre.env.held_out if pre.env else task.held_out
        if eval_before is None and cfg.eval_size and held_out and w.is_main:
            eval_before = {"kind": "eval", "when": "before", "step": 0,
                           **_evaluate(model, tok, pre, cfg, reward_fns, weights, sink, "before", sampler, stops,
                                       library)}
            sink.emit(eval_before)
        w.barrier()  # (the other ranks wait for rank 0's evaluation)

        interrupted, done, t_run, flat_steps, memory_warned = False, start, time.time(), 0, False
        wall_offset = max((r.get("wall_time", 0.0) for r in history if r.get("kind") == "train"), default=0.0)
        with _StopFlag(same_within=2.0 if w.distributed else 0.0) as stop_flag:
            for step in range(start, cfg.steps):
                tokens = token_budget(cfg, step)  # this step's completion budget (budget_schedule)
                step_cfg = cfg if tokens == cfg.max_new_tokens else replace(cfg, max_new_tokens=tokens)
                _overlong_budget(reward_fns, tokens)
                try:
                    if library is not None:
                        record = experience_step(model, tok, task, library, judge, step, step_cfg, reward_fns,
                                                 weights, stops, sampler)
                    elif cfg.objective == "sft":
                        record = sft_step(model, tok, optimizer, pre.env, step, step_cfg, stops, pre.budget)
                    elif pre.env:
                        record = agent_step(model, tok, optimizer, pre.env, step, step_cfg, stops, pre.context,
                                            pre.budget, reference, entropy.applied(cfg))
                    elif cfg.markovian_chunk:
                        record = markovian_step(model, tok, optimizer, task, step, step_cfg, reward_fns, weights,
                                                stops, pre.budget, reference, entropy.applied(cfg))
                    else:
                        record = train_step(model, tok, optimizer, task, step, step_cfg, reward_fns, weights, stops,
                                            pre.budget, sampler, reference, entropy.applied(cfg))
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not _is_out_of_memory(e):
                        raise
                    raise UserError(f"step {step + 1}: out of memory ({_first_line(e)}); lower group_size, "
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
                if not pre.env and cfg.objective != "sft":  # where the reward comes from
                    record["reward_shares"] = reward_shares(record["rewards"], dict(zip(reward_names(reward_fns),
                                                                                        weights)))
                if cfg.use_adaptive_entropy:
                    record["entropy_coef"] = entropy.applied(cfg)
                    entropy.observe(record.get("entropy"), cfg)
                if cfg.sync_ref_model and (step + 1) % cfg.ref_model_sync_steps == 0:
                    reference.sync(model, cfg.ref_model_mixup_alpha)
                    if cfg.reset_optimizer_on_sync:
                        optimizer.state.clear()
                    record["ref_synced"] = True
                record["wall_time"] = round(wall_offset + time.time() - t_run, 3)
                sink.emit(record)
                if library is not None and w.is_main:
                    library.save(run.experience_path)
                flat_steps = flat_steps + 1 if record.get("frac_reward_zero_std") == 1 else 0
                messages = ([no_signal_message(record, flat_steps, cfg.temperature)]
                            if flat_steps == FLAT_STEPS_WARNING else [])
                if check_name is not None:
                    hacked = hacking.observe(record["reward_mean"], record["rewards"].get(check_name), step + 1)
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
                        run.save_checkpoint(done, model, optimizer, cfg.keep_checkpoints,
                                            {"reference": reference.state, **entropy.state(),
                                             **({"experience": library.state()} if library is not None else {})})
                        sink.emit({"kind": "checkpoint", "step": done})
                    w.barrier()
                if stop:
                    interrupted = True
                    log(f"interrupted: saved checkpoint at step {done}; continue with --resume {run.path}")
                    break
        _overlong_budget(reward_fns, cfg.max_new_tokens)  # the held-out evaluation decodes up to max_new_tokens
        eval_after = None
        if not interrupted and cfg.eval_size and held_out and w.is_main:
            eval_after = {"kind": "eval", "when": "after", "step": done,
                          **_evaluate(model, tok, pre, cfg, reward_fns, weights, sink, "after", sampler, stops,
                                      library)}
            sink.emit(eval_after)
        w.barrier()
    finally:
        sink.close()
        if sampler is not None:
            sampler.close()
    return RunResult(run.path, done, interrupted, eval_before, eval_after)


def _overlong_budget(reward_fns, tokens: int) -> None:
    """The soft overlong punishment measured against ``tokens``, this step's completion budget."""
    for fn in reward_fns:
        if isinstance(fn, overlong_punishment):
            fn.max_len = tokens


def _open_run(cfg: TrainConfig, base: dict, resume: bool, w: World, log) -> Run:
    """The run directory: opened to resume (on every rank, which all load its checkpoint) or made by rank 0,
    whose path (or the one line saying why it cannot be) the other ranks receive."""
    if resume:
        run = Run.open(cfg.run_dir, "resume")
        run.check_base(base)
        return run
    if not w.distributed:
        return Run.create(cfg.run_dir or None, log)
    made: tuple[str, str] = ("", "")
    if w.is_main:
        try:
            made = (str(Run.create(cfg.run_dir or None, log).path), "")
        except UserError as e:
            made = ("", str(e))
    path, problem = w.broadcast(made)
    if problem:
        raise UserError(problem)
    return Run(path)


FLAT_STEPS_WARNING = 3  # consecutive steps without a learning signal before the run says so


def no_signal_message(record: dict, steps: int, temperature: float) -> tuple[str, str]:
    """(kind, text) when every group's completions scored alike for ``steps`` steps: a "note" when every
    completion solved its task (success: the data is learned), else a "warning" saying why nothing is learned."""
    reward, solved = record["reward_mean"], record.get("accuracy")
    if solved == 1:
        return "note", (f"every group solved for {steps} steps: the model has learned this data; consider harder "
                        f"data or stopping")
    if reward == 0 or solved == 0:
        cause = ("every completion failed: the model may never give an answer the reward can read "
                 "(check the answer format and system_prompt, the reward, and `localrl eval` samples), or the "
                 "task is too hard for it")
    else:
        cause = (f"each group's completions scored alike ({reward:.3g} on average, {solved:.0%} solved): some "
                 f"tasks are always solved and the others never; sampling may be too cold (temperature "
                 f"{temperature:g}) or the data too uneven for this model")
    if record["truncated"] > 0.5:
        cause += f"; {record['truncated']:.0%} of completions hit max_new_tokens, so raise it"
    return "warning", f"no learning signal for {steps} steps: {cause}"


def _evaluate(model, tok, pre: Preflight, cfg: TrainConfig, reward_fns, weights, sink: MetricsSink, when: str,
              sampler: LlamaCppRollout | None, stops: list[int], library: ExperienceLibrary | None = None) -> dict:
    """Held-out evaluation with a status record per batch, so watchers see its progress; decoded by the
    rollout backend (llama.cpp's greedy decoding of the same weights, when it samples the rollouts); with
    an experience ``library``, its lessons in the system message."""
    def progress(done: int, total: int) -> None:
        sink.emit(_status("eval", f"evaluating {when} training", when=when, done=done, total=total))

    completion_len = pre.budget.cfg.max_new_tokens  # (of a whole trajectory, for an agent)
    batch_size = pre.budget.rollout_prompts(cfg.eval_batch_size, 1, pre.longest_prompt, completion_len)
    if pre.env:
        return evaluate_episodes(model, tok, pre.env, cfg, stops, pre.context, progress, batch_size)
    task, generate = pre.task, None
    if cfg.markovian_chunk:  # greedy traces, chunk by chunk, as the rollouts are sampled

        def generate(prompts: list[list[int]]) -> Rollout:
            chunks = sample_markovian(model, prompts, 1, cfg.markovian_chunk, cfg.markovian_carry, cfg.max_new_tokens,
                                      stops, tok.pad_token_id, 0.0, 0)
            return trace_rollout(chunks, prompts, 1, tok.pad_token_id)
    elif sampler is not None:  # (Markovian runs sample with torch)
        batch_size = min(batch_size, sampler.sampler.max_rows)

        def generate(prompts: list[list[int]]) -> Rollout:
            return sampler.sample(model, prompts, 1, cfg.max_new_tokens, stops, tok.pad_token_id, 0.0, 0,
                                  cfg.lora_alpha)[0]

    system = library.system(task.system) if library is not None else task.system
    return evaluate(model, tok, task.held_out, reward_fns, weights, cfg.max_new_tokens, batch_size,
                    progress=progress, system=system, generate=generate)


def _is_out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def train_step(model, tok, optimizer, task, step: int, cfg: TrainConfig, reward_fns: list[RewardFn],
               weights: list[float], stops: list[int], budget=None, sampler=None, reference=None,
               entropy_coef: float | None = None) -> dict:
    """One whole GRPO step (sample, score, update) on ``task``'s rows of ``step``; returns its metrics record.
    ``sampler``: a LlamaCppRollout to sample with instead of the torch policy. With ``dynamic_sampling``,
    more rows are sampled while fewer than ``prompts_per_step`` groups have rewards that differ."""
    t0 = time.time()
    w = world()
    seed = cfg.seed * 1_000_003 + step
    model.eval()
    # this rank's prompts of the global batch (prompts_per_step x ranks), and their global indices
    share = w.shard(cfg.prompts_per_step)
    rows = task.sample(step, cfg.prompts_per_step * w.size, cfg.seed)[share]
    rounds = [_sample_round(model, tok, task, rows, cfg, reward_fns, stops, sampler, seed, share, budget)]
    while cfg.dynamic_sampling and len(rounds) <= cfg.dynamic_sampling_rounds and \
            sum(informative for r in rounds for informative in r.informative(weights)) < cfg.prompts_per_step:
        more = task.resample(step, len(rounds), cfg.prompts_per_step * w.size, cfg.seed)[share]
        rounds.append(_sample_round(model, tok, task, more, cfg, reward_fns, stops, sampler, seed + len(rounds),
                                    share, budget))
    t_gen = time.time() - t0
    rollout = concat_rollouts([r.rollout for r in rounds], tok.pad_token_id)
    scores = [sum((r.scores[i] for r in rounds), []) for i in range(len(reward_fns))]
    rewards = torch.tensor(combine(scores, weights), dtype=torch.float64)  # [all sampled rows]
    sampler_logp = _cat_right([r.sampler_logp for r in rounds]) if sampler is not None else None
    sampled_prompts = rollout.prompt_ids.size(0)
    if len(rounds) > 1:  # train on prompts_per_step groups: those with a signal first, in order
        flags = torch.tensor([f for r in rounds for f in r.informative(weights)])
        order = sorted(range(sampled_prompts), key=lambda b: not flags[b])[:cfg.prompts_per_step]
        keep = torch.zeros(sampled_prompts, dtype=torch.bool)
        keep[order] = True
        rows_kept = keep.repeat_interleave(cfg.group_size)
        train_rollout, train_rewards = rollout.groups(keep), rewards[rows_kept]
        if sampler_logp is not None:
            sampler_logp = sampler_logp[rows_kept, :train_rollout.completion_ids.size(1)]
    else:
        train_rollout, train_rewards = rollout, rewards
    stats = update(model, optimizer, train_rollout, train_rewards, cfg, step, budget, sampler_logp, reference,
                   entropy_coef)
    record = step_record(step, rewards, scores, reward_names(reward_fns), stats,  # of every completion sampled
                         rollout.completion_mask.sum(1).tolist(), rollout.truncated.float().mean().item(), t0, t_gen,
                         optimizer.param_groups[0]["lr"], next(model.parameters()).device)
    return {**record, **({"sampled_prompts": sampled_prompts} if cfg.dynamic_sampling else {})}


def experience_step(model, tok, task: Task, library: ExperienceLibrary, judge: Judge, step: int, cfg: TrainConfig,
                    reward_fns: list[RewardFn], weights: list[float], stops: list[int], sampler=None) -> dict:
    """One step of training-free GRPO (experience.py): sample and score the groups of ``step``'s rows with the
    library's lessons in the system message, then let the judge edit the library after each group whose
    completions part into right and wrong. No weight changes."""
    t0 = time.time()
    model.eval()
    rows = task.sample(step, cfg.prompts_per_step, cfg.seed)
    rnd = _sample_round(model, tok, replace(task, system=library.system(task.system)), rows, cfg, reward_fns, stops,
                        sampler, cfg.seed * 1_000_003 + step, slice(0, len(rows)))
    t_gen = time.time() - t0
    pairs = contrasting_pairs(rows, rnd.texts, rnd.scores[0], cfg.group_size)
    requests = [judge_request(question_text(row["prompt"]), str(row["answer"]), right, wrong, library)
                for row, right, wrong in pairs]
    replies = judge(requests, reply_start(library))
    changed = invalid = 0
    for reply in filter(None, replies):
        c, i = library.apply(parse_edits(reply))
        changed, invalid = changed + c, invalid + i
    rewards = torch.tensor(combine(rnd.scores, weights), dtype=torch.float64)
    informative = rnd.informative(weights)
    no_update = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "micro_batch": 0,
                 "frac_reward_zero_std": 1.0 - sum(informative) / len(informative)}
    record = step_record(step, rewards, rnd.scores, reward_names(reward_fns), no_update,
                         rnd.rollout.completion_mask.sum(1).tolist(), rnd.rollout.truncated.float().mean().item(), t0,
                         t_gen, 0.0, next(model.parameters()).device)
    return {
        **record,
        "lessons": len(library.lessons),
        "judged_groups": len(requests),
        "judge_too_long": sum(r is None for r in replies),
        "edits": changed,
        "invalid_edits": invalid,
        "judge_reply": next((r[:MAX_LESSON_CHARS] for r in replies if r), ""),  # the first, to see what it writes
    }


@dataclass
class _Round:
    """One round of a step's sampling: its rollout, the sampler's log-probabilities and the scores."""

    rollout: Rollout
    sampler_logp: torch.Tensor | None
    scores: list[list[float]]  # per reward function, per completion
    texts: list[str]  # the decoded completions

    def informative(self, weights: list[float]) -> list[bool]:
        """Per prompt: whether its group's combined rewards differ (a learning signal)."""
        g = self.rollout.group_size
        rewards = combine(self.scores, weights)
        return [len(set(rewards[b * g:(b + 1) * g])) > 1 for b in range(len(rewards) // g)]


def _sample_round(model, tok, task, rows, cfg: TrainConfig, reward_fns, stops, sampler, seed: int,
                  share: slice, budget: MemoryBudget | None = None) -> _Round:
    """Sample and score the groups of ``rows`` (the ``share`` of the round's global batch); each group draws
    from its own generator, seeded by (``seed``, its global index), whichever rank samples it, so sampling
    as many prompts at a time as the memory ``budget`` holds gives the same completions."""
    prompts, sampler_logp = encode_prompts(tok, rows, task.system), None
    if sampler is not None:
        rollout, sampler_logp = sampler.sample(model, prompts, cfg.group_size, cfg.max_new_tokens, stops,
                                               tok.pad_token_id, cfg.temperature, seed, cfg.lora_alpha)
    else:
        device = next(model.parameters()).device
        generators = group_generators(seed, range(share.start, share.start + len(rows)), device)
        at_once = len(prompts) if budget is None else budget.rollout_prompts(
            len(prompts), cfg.group_size, max(map(len, prompts)), cfg.max_new_tokens)
        rollout = sample_in_chunks(model, prompts, cfg.group_size, cfg.max_new_tokens, stops, tok.pad_token_id,
                                   cfg.temperature, generators, at_once)
    columns = {**columns_of(rows, cfg.group_size), "completion_ids": completion_token_ids(rollout)}
    texts = decode_completions(tok, rollout)
    return _Round(rollout, sampler_logp, score(reward_fns, texts, columns), texts)


def _cat_right(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[N_i, R_i] tensors as one [sum N_i, max R_i], zero-padded on the right."""
    width = max(t.size(1) for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.size(1))) for t in tensors])
