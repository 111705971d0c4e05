"""Reproducible pretraining of the built-in tiny models: the shared pretraining loop, and the reasoning
model tiny-arith (the terminal agent's data is in shell_pretraining.py; build.py names them all).

``localrl models build tiny-arith`` writes a Hugging Face Llama model directory
(config.json, tokenizer.json, model.safetensors, a chat template) pretrained from
scratch on synthetic scratchpad traces of the built-in addition task.

Deliberate choices:
- Byte-level BPE: every byte is a token, a handful of merges spell the prompt's fixed
  words (``user``, ``What``, `` is``, ``assistant``), and special and added tokens mark
  ChatML turns and the ``<think>``/``<answer>`` tags. Digits are never merged, so each is
  one token. It is a plain GPT-2-style BPE that llama.cpp reads.
- The traces forget each carry with probability ``drop_carry`` (0.6), so the model learns
  a systematic slip it makes more often than not: greedy decoding is right only on
  problems without carries (about 40% of held-out problems), while sampling still finds
  right answers often enough for GRPO to learn from.
- ``tiny-arith-conf`` (``confidence=True``) is the same model taught one more habit for calibration
  rewards (RLCR): every trace ends with ``<confidence>0.7</confidence>``, a confidence drawn uniformly
  from 0.0, 0.1, ..., 1.0 whatever the trace, so the confidence it states says nothing about whether it is
  right until reinforcement learning teaches it to. The tags are two more added tokens.
- ``tiny-arith-verbose`` (``restate=0.5``) ends half its traces' working with one redundant line, the
  whole sum restated as worked out (``457+68=525``), for the shrinking-budget recipe: a model whose
  traces can get shorter without getting worse.
- Loss on the assistant turn only; the prompt is context.
- Deterministic for a seed on one machine: one seeded generator for data and init,
  a fixed thread count, no dropout.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from localrl.atomic import atomic_dir
from localrl.data.arithmetic import sample_problems, worked_answer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
CONFIDENCE_TOKENS = ["<confidence>", "</confidence>"]  # added after the others, for the confidence recipe (RLCR)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class Pretraining:
    """Architecture and pretraining schedule of a built-in model."""

    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    intermediate_size: int = 384
    steps: int = 2400
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 100
    drop_carry: float = 0.6
    seed: int = 0
    threads: int = 2
    max_positions: int = 256
    confidence: bool = False  # end each trace with an uninformative <confidence> tag (tiny-arith-conf)
    restate: float = 0.0  # the chance a trace ends its working by restating the whole sum (tiny-arith-verbose)


# Whole-word merges for the words of every prompt; digits are never merged, so each digit
# stays one token. (llama.cpp also requires a BPE vocabulary to have merges.)
MERGED_WORDS = ["user", "What", "Ġis", "assistant"]


def _merges(words: list[str]) -> list[tuple[str, str]]:
    """Left-to-right merges that build each word from its characters."""
    out: list[tuple[str, str]] = []
    for word in words:
        for i in range(2, len(word) + 1):
            pair = (word[:i - 1], word[i - 1])
            if pair not in out:
                out.append(pair)
    return out


def build_tokenizer(confidence: bool = False):
    """A byte-level BPE tokenizer (256 byte tokens, a few word merges) with ChatML and reasoning tags (and,
    with ``confidence``, the confidence tags)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort(key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    merges = _merges(MERGED_WORDS)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Ids 256.. in a fixed order: special turn markers, then the reasoning tags, which are
    # ordinary added tokens (kept when decoding, like Qwen3's <think>).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    added = ADDED_TOKENS + (CONFIDENCE_TOKENS if confidence else [])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_of(char: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode table, so token id i is byte i."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    code = ord(char)
    if code in printable:
        return code
    return [b for b in range(256) if b not in printable][code - 256]


def encode_example(tok, question: str, completion: str) -> tuple[list[int], list[int]]:
    """Token ids of a full chat turn, and the loss mask (1 on the assistant's tokens)."""
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tok(completion + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return p_ids + c_ids, [0] * len(p_ids) + [1] * len(c_ids)


def _batch(tok, rng: random.Random, spec: Pretraining) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = [encode_example(tok, p.question, _trace(p, rng, spec)) for p in sample_problems(rng, spec.batch_size)]
    return pad_batch(rows, tok.pad_token_id)


def _trace(p, rng: random.Random, spec: Pretraining) -> str:
    """A pretraining completion for problem ``p``: the worked answer, with the extra habits ``spec`` asks for."""
    trace = worked_answer(p, rng, spec.drop_carry)
    if spec.restate and rng.random() < spec.restate:  # "...</think>" -> "...{a}+{b}={result}\n</think>"
        result = trace[trace.index("<answer>") + len("<answer>"):trace.index("</answer>")]
        trace = trace.replace("</think>", f"{p.a}+{p.b}={result}\n</think>", 1)
    return trace + _stated_confidence(rng, spec)


def _stated_confidence(rng: random.Random, spec: Pretraining) -> str:
    """The confidence a trace of a ``confidence`` model ends with: 0.0 to 1.0 in tenths, uniformly at random."""
    return f"<confidence>{rng.randint(0, 10) / 10:.1f}</confidence>" if spec.confidence else ""


def pad_batch(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, loss mask) rows right-padded to one length: (ids, loss mask, attention mask)."""
    n = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [pad] * (n - len(r)) for r, _ in rows])
    mask = torch.tensor([m + [0] * (n - len(m)) for _, m in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r, _ in rows])
    return ids, mask, attn


def arith_data(spec: Pretraining, rng: random.Random, log=print):
    """(tokenizer, batch function) of tiny-arith's pretraining."""
    tok = build_tokenizer(spec.confidence)

    def batch():
        return _batch(tok, rng, spec)

    return tok, batch


def pretrain(out_dir: str | Path, spec: Pretraining, data, log=print) -> Path:
    """Train a model from scratch on ``data(spec, rng, log)`` -> (tokenizer, batch function) and write it
    to ``out_dir`` atomically."""
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    tok, batch = data(spec, rng, log)
    model = train_lm(tok, batch, spec, log)
    return _save_atomic(model, tok, spec, Path(out_dir))


def train_lm(tok, batch, spec: Pretraining, log=print):
    """A Llama model of ``spec``'s shape trained from scratch on ``batch()`` -> (ids, loss mask, attention
    mask), cross-entropy on the masked tokens."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=spec.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"tiny model: {n_params / 1e6:.2f}M parameters, vocab {len(tok)}")
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / spec.warmup)
                                              * 0.5 * (1 + math.cos(math.pi * min(s, spec.steps) / spec.steps)))
    model.train()
    t0 = time.time()
    for step in range(spec.steps):
        ids, loss_mask, attn = batch()
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        target = ids[:, 1:]
        m = loss_mask[:, 1:].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none")
        loss = (nll * m.reshape(-1)).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == spec.steps - 1:
            log(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - t0:6.0f}s")
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, tok.pad_token_id], pad_token_id=tok.pad_token_id, do_sample=False)
    return model


def _save_atomic(model, tok, spec: Pretraining, out_dir: Path) -> Path:
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "pretraining.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return out_dir
