"""The data of the built-in world model of the shell, ``tiny-shell-world``: what the real shell did.

``spec.corpus_tasks`` tasks from the training split (never a held-out one), their names placeholders
(``task_names.Placeholders``), are each played twice in the sandbox, by the scripted expert and by the careless
one (``ShellTask.slip``), and every command is recorded as one transition: (the files before, the command) ->
(the output the agent saw, the files' changes), in the world format (``localrl.envs.world_format``) that
``--env world:tiny-shell-world`` asks it in. Each time a transition goes into a batch its placeholders become fresh
names (``task_names.rename``), as in tiny-shell's pretraining, so the model copies names rather than recalls them.
The loss is on the answer only. Every example starts with the world format's system message, as every world model
is asked (a served GGUF of it is asked over HTTP exactly as any other model is).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from localrl.envs.shell import ShellEnv, expert_call, task_list
from localrl.envs.shell_tasks import sample_tasks
from localrl.envs.task_names import Names, rename
from localrl.envs.world_format import WORLD_SYSTEM, answer, question, read_tree
from localrl.models.pretraining import pad_batch
from localrl.models.shell_pretraining import ShellPretraining, TAGS, build_tokenizer

WORLD_TAGS = TAGS + ["<output>", "</output>"]


@dataclass
class WorldPretraining(ShellPretraining):
    """tiny-shell-world's shape and schedule (``slip`` unused: every task is played both ways)."""


Transition = tuple[str, str]  # (the question, the answer), in the world format


def transitions(tasks, log=print) -> list[Transition]:
    """Every command of each task's expert and careless solutions, run in the sandbox, as a transition."""
    env = ShellEnv(task_list(tasks), max_turns=16)
    out = []
    for i, task in enumerate(tasks):
        for commands in (task.solution, task.slip):
            env.reset(i)
            for command in commands:
                before = read_tree(env.workdir)
                observation, _ = env.step(expert_call(command))
                out.append((question(before, command), answer(observation, before, read_tree(env.workdir))))
        if (i + 1) % 1000 == 0:
            log(f"transitions: {i + 1}/{len(tasks)} tasks, {len(out)} transitions")
    env.close()
    return out


def world_data(spec: WorldPretraining, rng: random.Random, log=print):
    """(tokenizer, batch function) of tiny-shell-world's pretraining."""
    tasks = sample_tasks(random.Random(rng.randrange(2**62)), spec.corpus_tasks, names="placeholders")
    corpus = transitions(tasks, log)
    names = Names(random.Random(rng.randrange(2**62)), "seen")
    tok = build_tokenizer([WORLD_SYSTEM] + [q + "\n" + a for q, a in corpus], spec.vocab_size, WORLD_TAGS)

    def encoded(pair: Transition) -> tuple[list[int], list[int]]:
        asked, answered = rename(list(pair), names)
        chat = [{"role": "system", "content": WORLD_SYSTEM}, {"role": "user", "content": asked}]
        prompt = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        reply = tok(answered + "<|im_end|>", add_special_tokens=False)["input_ids"]
        return prompt + reply, [0] * len(prompt) + [1] * len(reply)

    lengths = {i: len(encoded(t)[0]) for i, t in enumerate(corpus)}
    kept = [i for i in range(len(corpus)) if lengths[i] <= spec.max_positions - 32]  # room for longer names
    by_length = sorted(kept, key=lengths.get)
    log(f"transitions: {len(kept)} of {len(corpus)} fit, tokens: median {lengths[by_length[len(kept) // 2]]}, "
        f"max {lengths[by_length[-1]]}")

    def batch():
        start = rng.randrange(len(by_length) - spec.batch_size + 1)
        rows = [encoded(corpus[i]) for i in by_length[start:start + spec.batch_size]]
        return pad_batch([(ids[:spec.max_positions], mask[:spec.max_positions]) for ids, mask in rows],
                         tok.pad_token_id)

    return tok, batch
