"""GRPO with turn-level credit for agents (``--env ... --objective turn_grpo``): an episode's turns are credited
apart, from the rewards the environment gives after each turn (``localrl.policy.credit``: returns discounted by
``turn_discount``, normalised among the group's episodes turn index by turn index), and each turn's tokens carry
its own advantage through GRPO's loss. Everything else (the loss type, the KL, its reference and entropy state) is
GRPO's.
"""

from __future__ import annotations

from dataclasses import dataclass

from localrl.config import check_fields, setting
from localrl.errors import UserError
from localrl.objectives import objectives
from localrl.objectives.grpo import GRPO
from localrl.policy.credit import turn_advantages


@dataclass
class TurnSettings:
    """turn-level credit"""

    turn_discount: float = setting(1.0, "objective turn_grpo: discount of the turn rewards in each turn's return (1: "
                                        "the first turn's advantage is the episode's; 0: each turn credited with its "
                                        "own)")


@objectives.register("turn_grpo")
class TurnGRPO(GRPO):
    about = "GRPO with turn-level credit for multi-turn episodes (turn_discount)"
    settings = TurnSettings

    @staticmethod
    def check_settings(cfg) -> None:
        check_fields(cfg, [("turn_discount", 0 <= cfg.turn_discount <= 1, "must be in [0, 1]")])

    @staticmethod
    def check_selected(cfg) -> None:
        check_fields(cfg, [
            ("objective", bool(cfg.env), "turn_grpo credits the turns of an episode: it needs env"),
            ("loss_type", cfg.loss_type != "vespo",
             "vespo weighs whole sequences; turn_grpo's advantages are per token (another loss_type)"),
            ("off_policy_mask_threshold", not cfg.off_policy_mask_threshold,
             "masks whole completions by their advantage's sign; not with turn_grpo"),
        ])

    def check(self, w) -> None:
        w.one_process("objective", "turn_grpo")

    def update_terms(self, step: int, batch) -> dict:
        if batch.turn_spans is None:
            raise UserError("config field objective: turn_grpo needs a sampler of episodes (env)", field="objective")
        width = batch.rollout.completion_ids.size(1)
        return {"advantages": turn_advantages(batch.turn_spans, batch.turn_rewards, batch.rewards.tolist(),
                                              self.cfg.group_size, width, self.cfg.turn_discount)}

    def batch_record(self, batch) -> dict:
        given = [r for rewards in batch.turn_rewards for r in rewards]
        return {"turn_reward_mean": sum(given) / len(given) if given else None}  # the process rewards given
