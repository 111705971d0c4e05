"""Supervised warm start: a LoRA adapter learns an environment's expert trajectories before RL.

A model that has never written a tool call in the environment's format earns no reward, and
GRPO gets no signal from it. The common remedy is to fine-tune on real end-to-end trajectories
first. Here each step plays ``prompts_per_step`` training tasks with their expert solutions
(``envs.shell.solve``: the commands run in the sandbox, the answer read from the last output),
keeps the trajectories the verifier scores 1, encodes each exactly as this model's own rollout
would hold it (``episode_tokens``: the chat template's tokens between turns, the model's tokens
where it would sample them), and minimises the negative log-likelihood of the agent's tokens,
averaged over all agent tokens of the step (so the micro-batch size does not change the gradient).

The same step learns prompt-completion rows (TRL's SFT data, ``localrl.samplers.demonstrations``): their
completions' tokens are the trained ones, and ``demo_scores`` measures held-out rows as TRL's SFTTrainer logs them
(mean per-token loss, mean token accuracy).

The step itself is the ``sft`` objective (``localrl.objectives.sft``). ``localrl sft`` runs it as an ordinary run
(checkpoints, resume, held-out evaluations before and after); ``localrl train --init-adapter RUN`` then starts GRPO
from its adapter.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from localrl.config import TrainConfig
from localrl.envs import EnvSetup
from localrl.errors import UserError
from localrl.generation.agent_rollout import TurnFormat
from localrl.generation.rollout import Rollout, left_pad, stop_token_ids
from localrl.policy.grpo import row_slices
from localrl.policy.shared_prompt import ConcatForward, split_model


@dataclass
class Demo:
    """One expert episode: the task, its (agent turn, observation) turns, the verifier's score."""

    instruction: str
    turns: list[tuple[str, str]]  # the last turn is the answer (empty observation) when the episode answered
    reward: float


def expert_demos(setup: EnvSetup, seeds: list[int], workers: int = 8) -> list[Demo]:
    """The expert's episode of each seed's training task, played in the environment (``workers`` at once)."""
    def play(seed: int) -> Demo:
        env = setup.make_env()
        try:
            reward, turns = setup.expert(env, seed)
            return Demo(env.task.instruction, turns, reward)
        finally:
            env.close()

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(play, seeds))


def end_of_turn(fmt: TurnFormat, stop_ids: list[int]) -> int:
    """The token a model ends its answer with: the first token of the template's closing of an assistant
    message where that stops sampling (``<|im_end|>``, ``<|eot_id|>``), else the first stop token."""
    closing = fmt.tok(fmt.close, add_special_tokens=False)["input_ids"]
    return closing[0] if closing and closing[0] in stop_ids else stop_ids[0]


def completion_end(tok, model) -> int:
    """The token that ends a completion handed over as text (a pair's, a demonstration's): the end of an assistant
    turn, or the first stop token for a template that rewrites earlier turns."""
    try:
        return end_of_turn(TurnFormat(tok, None), stop_token_ids(tok, model))
    except UserError:
        return stop_token_ids(tok, model)[0]


def episode_tokens(fmt: TurnFormat, instruction: str, turns: list[tuple[str, str]], end_id: int,
                   end_every_turn: bool = False) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, trajectory ids, loss mask over the trajectory) of an episode, as a rollout holds it: the
    agent's turns (mask 1) and, after each tool call, the environment's tokens (``TurnFormat.between``, mask
    0). A sampled tool-call turn stops at ``</tool_call>``, so only the answer ends with ``end_id``, unless
    ``end_every_turn`` (the built-in agent's corpus, which closes every turn itself)."""
    tok = fmt.tok
    ids: list[int] = []
    mask: list[int] = []
    for action, observation in turns:
        turn = tok(action, add_special_tokens=False)["input_ids"]
        if end_every_turn or not observation:
            turn = turn + [end_id]
        ids += turn
        mask += [1] * len(turn)
        if observation:
            between = fmt.between(turn, observation)
            ids += between
            mask += [0] * len(between)
    return fmt.prompt_ids(instruction), ids, mask


def demo_rollout(fmt: TurnFormat, demos: list[Demo], end_id: int) -> Rollout:
    """Demonstrations as a rollout of one completion per prompt, the loss mask on the agent's tokens."""
    encoded = [episode_tokens(fmt, d.instruction, d.turns, end_id) for d in demos]
    prompt_ids, prompt_mask = left_pad([p for p, _, _ in encoded], fmt.tok.pad_token_id)
    width = max(len(ids) for _, ids, _ in encoded)
    ids = torch.full((len(encoded), width), fmt.tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(encoded), width, dtype=torch.long)
    own = torch.zeros(len(encoded), width, dtype=torch.long)
    for i, (_, row, row_own) in enumerate(encoded):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
        own[i, :len(row)] = torch.tensor(row_own)
    return Rollout(prompt_ids, prompt_mask, ids, mask, torch.zeros(len(encoded), dtype=torch.bool), 1,
                   loss_mask=own)


def nll_step(model, optimizer, rollout: Rollout, cfg: TrainConfig, micro_batch: int = 0,
             logits_chunk: int = 1024) -> float:
    """One optimizer step on the mean negative log-likelihood of ``rollout``'s trained tokens; returns it.

    Every micro-batch's loss is divided by the token count of the whole batch, so the gradient is the
    same for any micro-batch size. Prompts are not shared here (one completion each), so the forward
    concatenates prompt and completion."""
    device = next(model.parameters()).device
    mask = rollout.trained_mask.to(device).float()
    n = mask.sum().clamp(min=1.0)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    with ConcatForward(model, rollout, 1.0, logits_chunk) as fwd:
        for rows in row_slices(rollout.completion_ids.size(0), micro_batch):
            loss = -(fwd.logprobs(rows) * mask[rows]).sum() / n
            loss.backward()
            total += loss.item()
    if cfg.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm)
    optimizer.step()
    return total


@torch.no_grad()
def demo_scores(model, rollout: Rollout, batch_size: int = 8) -> dict:
    """Held-out demonstrations, teacher-forced: ``loss``, the mean negative log-likelihood of their trained tokens;
    ``accuracy``, the share of those tokens that are the model's most likely next token (TRL's
    ``mean_token_accuracy``); ``n``, the rows. The output head runs only at the trained tokens' positions."""
    backbone, head = split_model(model)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll = right = tokens = 0.0
    for rows in row_slices(rollout.completion_ids.size(0), batch_size):
        c_ids = rollout.completion_ids[rows].to(device)
        prompt_ids, prompt_mask = rollout.row_prompts(rows)
        ids = torch.cat([prompt_ids.to(device), c_ids[:, :-1]], dim=1)
        mask = torch.cat([prompt_mask, rollout.completion_mask[rows][:, :-1]], dim=1).to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        where = rollout.trained_mask[rows].to(device).bool()
        logits = head(hidden[:, -c_ids.size(1):][where]).float()  # [N, V]: only the trained tokens
        targets = c_ids[where]
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        right += (logits.argmax(-1) == targets).sum().item()
        tokens += targets.numel()
    model.train(was_training)
    return {"loss": nll / max(tokens, 1), "accuracy": right / max(tokens, 1), "n": rollout.completion_ids.size(0),
            "tokens": int(tokens)}
