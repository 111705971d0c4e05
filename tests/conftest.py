"""Shared fixtures: tiny random models of each supported family, built on the fly (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))

ARCH_CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}


CORPUS = ["The quick brown fox jumps over the lazy dog.", "What is 457 + 68? The answer is 525.",
          "Reinforcement learning with verifiable rewards trains small reasoning models.",
          "<think>First add the units, then the tens.</think><answer>42</answer>"] * 20


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_bpe_tokenizer(llama3_split: bool = False):
    """A GPT-2-style byte-level BPE tokenizer trained on a small corpus, with ChatML tokens and template;
    with Llama 3's split pattern (digits in groups of up to three) if ``llama3_split``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from models.recipe import ADDED_TOKENS, CHAT_TEMPLATE, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if llama3_split:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.add_tokens(ADDED_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def train_spm_tokenizer(workdir: Path, chatml: bool = False):
    """A SentencePiece BPE model with byte fallback (as Llama 2 and Mistral ship), trained by the
    sentencepiece library and converted by transformers; with ChatML tokens and template if ``chatml``."""
    import sentencepiece
    from transformers import LlamaTokenizer

    from models.recipe import CHAT_TEMPLATE

    workdir.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(workdir / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", minloglevel=2)
    tok = LlamaTokenizer.from_pretrained(workdir, add_bos_token=not chatml)  # Llama 2 adds <s>
    if chatml:
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.eos_token = "<|im_end|>"
        tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(out: Path, arch: str, tie: bool = False, seed: int = 0, tokenizer: str = "builtin") -> Path:
    """A randomly initialised ~0.2M-parameter model of ``arch`` with a tokenizer: the built-in one,
    "bpe" (trained byte-level BPE), "bpe-llama3" (the same with Llama 3's split), "spm" (trained
    SentencePiece BPE) or "spm-chatml"."""
    import transformers
    from transformers import AutoModelForCausalLM

    from models.recipe import build_tokenizer

    if tokenizer.startswith("spm"):
        tok = train_spm_tokenizer(out.with_name(out.name + "-spm"), chatml=tokenizer == "spm-chatml")
    else:
        tok = train_bpe_tokenizer(tokenizer == "bpe-llama3") if tokenizer.startswith("bpe") else build_tokenizer()
    config = getattr(transformers, ARCH_CONFIGS[arch])(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=tie, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    if arch == "qwen3":
        config.head_dim = 16
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCH_CONFIGS}


@pytest.fixture(scope="session")
def builtin_model() -> Path:
    from models import DEFAULT, builtin_path

    path = builtin_path(DEFAULT)
    assert (path / "config.json").is_file(), "the built-in model is not built: localrl models build tiny-arith"
    return path
