"""The data of the built-in terminal agent, ``tiny-shell``: trajectories of scripted solvers.

``spec.corpus_tasks`` tasks from the training split (never a held-out one), their names placeholders
(``task_names.Placeholders``), are played once
each in the sandbox by a scripted agent that types the task's expert commands, or with
probability ``spec.slip`` its careless ones (``ShellTask.slip``: ``wc -w`` for ``wc -l``, a
lowercase grep, ``sed`` without ``-i``, ...), then answers from the last output. The model
learns the protocol (one ``<tool_call>`` per turn, ``<answer>`` at the end) and both habits,
the careless one more often, so greedy decoding solves only some tasks before RL, while
sampling finds right trajectories often enough for GRPO to learn from. Each time an episode goes into a
batch its placeholders become fresh names from the seen side of the vocabulary (``task_names.rename``), so
the model meets some hundred thousand names and must copy them from the task: a corpus with fixed names was
memorised, names and all, and miscopied names it had not seen (``vuzatu.csv`` became ``tezatu.csv``).

The trajectories are encoded exactly as a multi-turn rollout sees them (``TurnFormat``: the
chat template's tokens around each tool response), with loss on the agent's turns only. The
tokenizer is a byte-level BPE trained on these conversations (``spec.vocab_size``), with
ChatML turn markers and the tool-call and answer tags as single tokens. There is no system
prompt: the model learns the protocol itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


from localrl.envs.shell import ShellEnv, solve, task_list
from localrl.envs.shell_tasks import sample_tasks
from localrl.envs.task_names import Names, rename
from localrl.generation.agent_rollout import TurnFormat
from localrl.models.pretraining import CHAT_TEMPLATE, SPECIAL_TOKENS, Pretraining, pad_batch
from localrl.policy.sft import episode_tokens

@dataclass
class ShellPretraining(Pretraining):
    corpus_tasks: int = 4000  # training-split tasks played once each; batches sample from them
    slip: float = 0.6  # how often the scripted agent types the careless commands
    vocab_size: int = 1024  # byte-level BPE trained on the trajectories


TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<answer>", "</answer>", "<think>",
        "</think>"]


def trajectories(spec: ShellPretraining, rng: random.Random, log=print) -> list[tuple[str, list[tuple[str, str]]]]:
    """(instruction, [(agent turn, observation), ...]) for each corpus task; the last turn is the answer."""
    tasks = sample_tasks(random.Random(rng.randrange(2**62)), spec.corpus_tasks, names="placeholders")
    env = ShellEnv(task_list(tasks), max_turns=8)
    out = []
    for i, task in enumerate(tasks):
        _, turns = solve(env, i, slip=rng.random() < spec.slip)
        out.append((task.instruction, turns))
        if (i + 1) % 1000 == 0:
            log(f"trajectories: {i + 1}/{len(tasks)}")
    env.close()
    return out


def build_tokenizer(texts: list[str], vocab_size: int, tags: list[str] = TAGS):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode(tok, fmt: TurnFormat, instruction: str, turns: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of a whole episode as a rollout builds it, and the loss mask (1 on the agent's tokens); every
    agent turn ends with ``<|im_end|>``."""
    prompt, ids, mask = episode_tokens(fmt, instruction, turns, tok.convert_tokens_to_ids("<|im_end|>"), True)
    return prompt + ids, [0] * len(prompt) + mask


def renamed(episode: tuple[str, list[tuple[str, str]]], names: Names) -> tuple[str, list[tuple[str, str]]]:
    """An episode with fresh names for its placeholders, the same ones in its instruction, commands and outputs."""
    instruction, turns = episode
    texts = rename([instruction] + [t for turn in turns for t in turn], names)
    return texts[0], list(zip(texts[1::2], texts[2::2]))


def shell_data(spec: ShellPretraining, rng: random.Random, log=print):
    """(tokenizer, batch function) of tiny-shell's pretraining."""
    corpus = trajectories(spec, rng, log)
    names = Names(random.Random(rng.randrange(2**62)), "seen")
    # The tokenizer learns its merges from the episodes with their placeholders, so they spell the tasks' wording
    # and commands, never a name: every name, seen or unseen, is spelt with the same short pieces, and copying a
    # name the model never met is the same act as copying one it trained on.
    texts = [instruction + "\n" + "\n".join(f"{a}\n{o}" for a, o in turns) for instruction, turns in corpus]
    tok = build_tokenizer(texts, spec.vocab_size)
    fmt = TurnFormat(tok, None)
    lengths = {i: len(encode(tok, fmt, *renamed(e, names))[0]) for i, e in enumerate(corpus)}
    kept = [i for i in range(len(corpus)) if lengths[i] <= spec.max_positions - 32]  # room for longer names
    by_length = sorted(kept, key=lengths.get)  # episodes of similar lengths together: little of a batch is padding
    log(f"trajectories: {len(kept)}, tokens per episode: median {lengths[by_length[len(kept) // 2]]}, "
        f"max {lengths[by_length[-1]]}")

    def batch():  # each episode with fresh names, every time
        start = rng.randrange(len(by_length) - spec.batch_size + 1)
        rows = [encode(tok, fmt, *renamed(corpus[i], names)) for i in by_length[start:start + spec.batch_size]]
        rows = [(ids[:spec.max_positions], mask[:spec.max_positions]) for ids, mask in rows]
        return pad_batch(rows, tok.pad_token_id)

    return tok, batch
