"""``localrl bench grpo-step``: whole GRPO steps of localrl and of TRL's GRPOTrainer on the same model, with prompts
built to an exact token count (``exact_length_prompts``) and completions of exactly R tokens; both counts are
checked on what each trainer saw."""

from __future__ import annotations

import gc
import random
import statistics
import string
import time
from pathlib import Path

import torch

from localrl.benchmarks.harness import BENCH_SHAPE
from localrl.errors import UserError

# Characters the grpo-step prompts are drawn from; merges between them are undone by exact_length_prompts.
PROMPT_ALPHABET = string.ascii_lowercase + " "


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
        import trl  # noqa: F401
    except ImportError:
        raise UserError("bench grpo-step: needs TRL (pip install -e '.[bench]')") from None
    from localrl.config import TrainConfig
    from localrl.modeling import load_tokenizer
    from localrl.models.pretraining import build_tokenizer

    if prompt_len < 1 or completion_len < 1 or group < 2 or steps < 1:
        raise UserError("bench grpo-step: need --prompt-len and --completion-len >= 1, --group >= 2, --repeats >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(_bench_policy_dir(Path(tmp) / "model", build_tokenizer(), model_shape))
        tok = load_tokenizer(path)  # as both trainers load it, so the prompts are measured with the same one
        rows = [{"prompt": p, "answer": "0"} for p in exact_length_prompts(tok, prompt_len, steps + 1)]
        cfg = TrainConfig(model=path, data="rows", prompts_per_step=1, group_size=group,
                          max_new_tokens=completion_len, beta=0.0, eval_size=0).validate()
        ours, ours_seen = _localrl_steps(path, tok, rows, cfg, steps)
        log(f"localrl steps (s): {', '.join(f'{t:.2f}' for t in ours)}")
        gc.collect()
        theirs, trl_seen = _trl_steps(path, tok, rows, cfg, steps, Path(tmp) / "trl")
        log(f"TRL steps (s):     {', '.join(f'{t:.2f}' for t in theirs)}")

    # The comparison only holds if both did the same work: say so loudly rather than print a ratio.
    for what, lengths in {**ours_seen, **trl_seen}.items():
        want = prompt_len if what.endswith("prompt") else completion_len
        if not lengths:  # TRL renamed the hooks these are read from: fix the bench, do not skip the check
            raise RuntimeError(f"bench grpo-step: {what} lengths were not observed; cannot check they are {want}")
        if any(n != want for n in lengths):
            raise RuntimeError(f"bench grpo-step: {what} lengths {sorted(set(lengths))}, expected {want} "
                               f"tokens each; the comparison would not be like for like")
    if len(ours) != steps + 1 or len(theirs) != steps + 1:
        raise RuntimeError(f"bench grpo-step: timed {len(ours)} localrl and {len(theirs)} TRL steps, "
                           f"expected {steps + 1} each")
    log(f"checked: every prompt was {prompt_len} tokens and every completion {completion_len} tokens in both")

    t_ours, t_trl = statistics.median(ours[1:]), statistics.median(theirs[1:])
    result = {"P": prompt_len, "R": completion_len, "G": group, "localrl_s": t_ours, "trl_s": t_trl,
              "speedup": t_trl / t_ours}
    log(f"whole GRPO step, P={prompt_len} R={completion_len} G={group}: localrl {t_ours:.2f} s, "
        f"TRL GRPOTrainer {t_trl:.2f} s -> localrl {t_trl / t_ours:.2f}x faster")
    return result


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")


def _localrl_steps(path: str, tok, rows: list[dict], cfg, steps: int) -> tuple[list[float], dict[str, list[int]]]:
    """``steps`` + 1 of localrl's own step function, stop tokens disabled so that every completion has R tokens:
    each step's seconds, and the prompt and completion lengths it saw."""
    from peft import get_peft_model

    from localrl.data import Task
    from localrl.generation.rollout import encode_prompts
    from localrl.modeling import load_base
    from localrl.objectives.grpo import step_on_task

    seen = {"localrl prompt": [len(ids) for ids in encode_prompts(tok, rows)], "localrl completion": []}
    torch.manual_seed(0)
    model = get_peft_model(load_base(path, True, torch.device("cpu")), _lora())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    task, times = Task("rows", rows, []), []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        record = step_on_task(model, tok, optimizer, task, step, cfg, [distinct_chars], [1.0], stops=[])
        times.append(time.perf_counter() - t0)
        seen["localrl completion"].append(record["completion_len"])  # mean tokens a completion; all cut at R
        if record["frac_reward_zero_std"] > 0:  # such groups would be left out of localrl's update
            raise RuntimeError("bench grpo-step: a group's completions all scored alike; the comparison "
                               "needs every completion in the update, as TRL computes it")
    return times, seen


def _trl_steps(path: str, tok, rows: list[dict], cfg, steps: int, out: Path
               ) -> tuple[list[float], dict[str, list[int]]]:
    """``steps`` + 1 of TRL's GRPOTrainer on the same 4-bit base with the same adapters: each step's seconds, and
    the prompt and completion lengths it saw (read from its own tokenising and the reward's arguments)."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from localrl.modeling import load_base

    seen: dict[str, list[int]] = {"TRL prompt": [], "TRL completion": []}
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    class CheckedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer unchanged, but recording how many tokens each prompt it encoded has."""

        def _tokenize_prompts(self, prompts):
            encoded = super()._tokenize_prompts(prompts)
            seen["TRL prompt"].extend(len(ids) for ids in encoded[0])
            return encoded

    def reward(completions, completion_ids, **kw) -> list[float]:
        seen["TRL completion"].extend(len(ids) for ids in completion_ids)  # after TRL cut at any eos
        return distinct_chars(completions)

    reward.__name__ = distinct_chars.__name__  # TRL names its reward metrics after the function
    torch.manual_seed(0)
    model = get_peft_model(load_base(path, True, torch.device("cpu")), _lora())
    model.train()
    g, r = cfg.group_size, cfg.max_new_tokens
    args = GRPOConfig(output_dir=str(out), use_cpu=True, num_generations=g, per_device_train_batch_size=g,
                      gradient_accumulation_steps=1, max_completion_length=r, generation_kwargs={"min_new_tokens": r},
                      max_steps=steps + 1, beta=0.0, learning_rate=cfg.lr, logging_steps=1000, report_to="none",
                      save_strategy="no", bf16=False, fp16=False, shuffle_dataset=False, seed=0, disable_tqdm=True)
    CheckedGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                       processing_class=tok, callbacks=[StepTimer()]).train()
    return times, seen
