"""Self-play in a two-policy game (``--env NAME`` of a ``localrl.envs.Game``, such as ``secret_keeping``): two
adapters on one base, trained in alternation. Selected by a game's ``env``.

The run's own adapter (PEFT's ``default``: what checkpoints, exports and ``localrl eval`` take as the run's model)
is the game's second player, the one evaluated (the defender); ``start`` adds the first player's adapter (the
attacker) to the same PEFT model, a LoRA of the same rank, so the base is held once. The optimizer holds both;
a step trains one, ``self_play_round`` steps at a time, the first player first: only the learner's adapter is
active in the update's forward, so only it gets gradients, and AdamW leaves a parameter without one as it is.
Checkpoints hold both adapters (PEFT's layout: the first player's in a folder of its name), so a resumed run goes
on as the uninterrupted one would.

A step plays ``prompts_per_step`` games drawn from (seed, step):
  the first player learns: ``group_size`` turns of each game (sampled), each answered by one greedy reply;
  the second learns: one sampled turn of each game, answered by ``group_size`` sampled replies;
and the learner's rows are the group: GRPO's advantages compare turns of one game, or replies to one turn. The
step record says who learned (``player``) and carries, as means over the step's replies, ``attack_success`` (the
first player's reward), ``defended`` (the second's) and the game's own figures (``game_NAME``: the secret-keeping
game's ``game_control``), and the attacks' diversity (``attack_distinct_1`` and ``_2``: distinct word n-grams over
all n-grams of the step's first turns).

The held-out evaluation is the game's fixed set of first turns, answered greedily by the second player: the share
defended (``accuracy``), the leak rate and the control questions' accuracy, overall and per family.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from localrl.config import FIELDS, check_fields, setting
from localrl.envs import Game, environment_for, is_game, task_seeds
from localrl.errors import UserError
from localrl.generation.rollout import (Rollout, decode_completions, encode_prompts, group_generators, sample_groups,
                                        sample_in_chunks)
from localrl.samplers import Batch, Measure, ModelInfo, Plan, Sampler, samplers
from localrl.samplers.episodes import family_success, wilson

FIRST = "attacker"  # the PEFT adapter of the first player (the second's is the run's own, "default")
SECOND = "default"

def distinct_ngrams(texts: list[str], n: int) -> float:
    """Distinct word n-grams over all n-grams of ``texts`` (lowercased, split on whitespace); 0 with none."""
    grams = [tuple(words[i:i + n]) for words in (t.lower().split() for t in texts) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def game_figures(outcomes: list[dict]) -> dict[str, float]:
    """The means over ``outcomes`` of the first player's reward (``attack_success``), the second's (``defended``)
    and each of the game's own figures (``game_NAME``)."""
    n = max(len(outcomes), 1)
    figures = {"attack_success": sum(o["rewards"][0] for o in outcomes) / n,
               "defended": sum(o["rewards"][1] for o in outcomes) / n}
    for key in (outcomes[0] if outcomes else {}):
        if key != "rewards":
            figures[f"game_{key}"] = sum(o[key] for o in outcomes) / n
    return figures


@dataclass
class SelfPlaySettings:
    """two-policy games"""

    self_play_round: int = setting(1, "self-play: steps each player trains before the other does (the first player, "
                                      "the attacker, first)")
    turn_tokens: int = setting(48, "self-play: the first player's turn (the attack), in tokens; the reply has "
                                   "max_new_tokens")


@samplers.register("self_play")
class SelfPlay(Sampler):
    about = "a two-policy game's two adapters, trained in turn; picked by a game's env"
    settings = SelfPlaySettings
    measure = Measure("defended", "attacks", "greedy replies")  # its second player's replies to fixed first turns
    needs = {"group_relative": "it trains each player by GRPO over its group"}

    def __init__(self, cfg, rewards=None):
        super().__init__(cfg)
        self.game: Game | None = None

    @classmethod
    def selects(cls, cfg) -> bool:
        return bool(cfg.env) and is_game(cfg.env)

    @staticmethod
    def check_settings(cfg) -> None:
        game = bool(cfg.env) and is_game(cfg.env)
        check_fields(cfg, [
            ("self_play_round", cfg.self_play_round >= 1, "must be at least 1"),
            ("turn_tokens", cfg.turn_tokens >= 1, "must be at least 1"),
            ("sync_ref_model", not (game and cfg.sync_ref_model), "the KL reference of self-play is the base (no sync)"),
            ("unsloth", not (game and cfg.unsloth), "self-play's second adapter is PEFT's (not with unsloth)"),
            ("max_turns", not game or cfg.max_turns == FIELDS["max_turns"].default,
             "a game has one turn each (max_turns is for env episodes)"),
            ("process_reward", not (game and cfg.process_reward), "a game scores its replies itself"),
        ])

    def check(self, w) -> None:
        w.one_process("env", self.cfg.env)

    def prepare(self, info: ModelInfo | None, reserve: int = 0) -> Plan:
        """The game, its held-out turns against the model's context, and the longest rows for the planner: the
        second player's prompt holds the first player's turn at its longest."""
        cfg = self.cfg
        self.game = environment_for(cfg)
        if info is None:
            return Plan(0, cfg.max_new_tokens)
        tok, context = info.tok, info.context or 2048
        held = [self._prompt(tok, self.game.second_messages(s, s["turn"])) for s in self.game.held_out]
        widest = max((self._prompt(tok, self.game.second_messages(self.game.setting(seed), "")) for seed in range(64)),
                     key=len)
        longest = max([len(widest) + cfg.turn_tokens, *map(len, held)])
        if longest + cfg.max_new_tokens > context:
            raise UserError(f"config field max_new_tokens: the {cfg.env} game's replies are prompted with up to "
                            f"{longest} tokens (turn_tokens {cfg.turn_tokens}); with max_new_tokens "
                            f"{cfg.max_new_tokens} they do not fit the model's context of {context} tokens",
                            field="max_new_tokens")
        from localrl.memory import ModelShape

        second_adapter = 16 * ModelShape.from_config(info.config).lora_params(cfg.lora_rank)  # fp32 + grad + AdamW
        why = (f"rollouts: torch, self-play of {' and '.join(self.game.players)} (adapters on one base, "
               f"{cfg.self_play_round} step{'s' * (cfg.self_play_round > 1)} each in turn)")
        return Plan(longest, max(cfg.max_new_tokens, cfg.turn_tokens), "torch", why, extra_bytes=second_adapter)

    def start(self, model, tok, budget) -> None:
        """The first player's adapter beside the run's own, both trainable, so that the optimizer holds both."""
        if FIRST not in model.peft_config:
            model.add_adapter(FIRST, copy.deepcopy(model.peft_config[SECOND]))
        model.set_adapter(SECOND)
        for name, p in model.named_parameters():  # (set_adapter freezes the inactive one)
            if "lora_" in name:
                p.requires_grad_(True)

    @property
    def held_out(self) -> list:
        return self.game.held_out if self.game is not None else []

    def describe_eval(self) -> str:
        return f"on the {self.cfg.env} game's held-out first turns"

    @staticmethod
    def eval_line(r: dict) -> str:
        lo, hi = r["interval"]
        control = f", control questions right {r['game_control']:.1%}" if "game_control" in r else ""
        return (f"defended {r['accuracy']:.1%} [95% CI {lo:.1%}, {hi:.1%}], attacks succeeded "
                f"{r['attack_success']:.1%}{control} ({r['n']} held-out attacks of {r['held_out_set']}, greedy)")

    def learner(self, step: int) -> int:
        """Which player trains at 0-based ``step``: 0 (the first) for ``self_play_round`` steps, then 1, ..."""
        return (step // self.cfg.self_play_round) % 2

    @staticmethod
    def _prompt(tok, messages: list[dict]) -> list[int]:
        return encode_prompts(tok, [{"prompt": messages}])[0]

    def _complete(self, ctx, prompts: list[list[int]], group: int, tokens: int, temperature: float, seed: int
                  ) -> Rollout:
        generators = group_generators(seed, range(len(prompts)), ctx.device) if temperature > 0 else None
        at_once = len(prompts) if ctx.budget is None else ctx.budget.rollout_prompts(
            len(prompts), group, max(map(len, prompts)), tokens)
        return sample_in_chunks(ctx.model, prompts, group, tokens, ctx.stops, ctx.tok.pad_token_id, temperature,
                                generators, at_once)

    def sample(self, ctx, step: int, tokens: int, system=lambda s: s) -> Batch:
        cfg, model, tok, game = self.cfg, ctx.model, ctx.tok, self.game
        t0 = time.time()
        model.eval()
        learner, g = self.learner(step), cfg.group_size
        settings = [game.setting(s) for s in task_seeds(cfg, step)]
        seed = 2 * (cfg.seed * 1_000_003 + step)  # the turns' generators; the replies' are seed + 1
        model.set_adapter(FIRST)
        first = self._complete(ctx, [self._prompt(tok, game.first_messages(s)) for s in settings],
                               g if learner == 0 else 1, cfg.turn_tokens, cfg.temperature, seed)
        turns = decode_completions(tok, first)
        played = [s for s in settings for _ in range(first.group_size)]  # each turn's game
        model.set_adapter(SECOND)
        second = self._complete(ctx, [self._prompt(tok, game.second_messages(s, t)) for s, t in zip(played, turns)],
                                g if learner == 1 else 1, tokens, cfg.temperature if learner == 1 else 0.0, seed + 1)
        replies = decode_completions(tok, second)
        answered = [(s, t) for s, t in zip(played, turns) for _ in range(second.group_size)]  # each reply's
        outcomes = [game.outcome(s, t, r) for (s, t), r in zip(answered, replies)]
        model.set_adapter(FIRST if learner == 0 else SECOND)  # the update's forward: the learner's adapter alone
        rollout = first if learner == 0 else second
        rewards = [o["rewards"][learner] for o in outcomes]
        figures = game_figures(outcomes)
        name = game.players[learner]
        extra = {"player": name, **{k: round(v, 4) for k, v in figures.items()},
                 "attack_distinct_1": round(distinct_ngrams(turns, 1), 4),
                 "attack_distinct_2": round(distinct_ngrams(turns, 2), 4)}
        return Batch(rollout, torch.tensor(rewards, dtype=torch.float64), [rewards], [name],
                     rollout.completion_mask.sum(1).tolist(), rollout.truncated.float().mean().item(), time.time() - t0,
                     cfg.turn_tokens if learner == 0 else tokens, texts=turns if learner == 0 else replies,
                     extra=extra)

    @torch.no_grad()
    def evaluate(self, model, tok, progress=None, batch_size: int = 64, system=lambda s: s, samples: int = 0,
                 stops: list[int] | None = None) -> dict:
        """The second player's greedy replies to the held-out first turns: the share it defended (``accuracy``),
        each of the game's figures (the leak rate, the control questions'), overall and per family."""
        from localrl.generation.rollout import stop_token_ids

        cfg, game = self.cfg, self.game
        stops = stops if stops is not None else stop_token_ids(tok, model)
        rows = game.held_out
        was_training = model.training
        model.eval()
        if FIRST in getattr(model, "peft_config", {}):  # (a run's model: its own adapter answers)
            model.set_adapter(SECOND)
        prompts = [self._prompt(tok, game.second_messages(r, r["turn"])) for r in rows]
        replies = []
        for i in range(0, len(prompts), batch_size):
            if progress is not None:
                progress(i, len(prompts))
            out = sample_groups(model, prompts[i:i + batch_size], 1, cfg.max_new_tokens, stops, tok.pad_token_id, 0.0)
            replies += decode_completions(tok, out)
        if progress is not None:
            progress(len(prompts), len(prompts))
        model.train(was_training)
        outcomes = [game.outcome(r, r["turn"], reply) for r, reply in zip(rows, replies)]
        wins = [o["rewards"][1] for o in outcomes]
        by_family = defaultdict(list)
        for r, w in zip(rows, wins):
            by_family[r.get("family", "all")].append(w)
        n, won = len(wins), sum(w == 1.0 for w in wins)
        result = {"accuracy": won / max(n, 1), "interval": wilson(won, n), "reward_mean": sum(wins) / max(n, 1),
                  "n": n, **game_figures(outcomes),
                  "held_out_set": game.held_out_name,
                  "families": family_success(by_family)}
        if samples:
            result["samples"] = [{"turn": r["turn"], "family": r.get("family", "all"), "reply": reply,
                                  "reward": o["rewards"][1]}
                                 for r, reply, o in list(zip(rows, replies, outcomes))[:samples]]
        return result
