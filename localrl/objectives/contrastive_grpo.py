"""Contrastive GRPO: GRPO's step, with a term that contrasts each group's right and wrong completions added to its
loss. The term (``localrl.policy.contrastive``) is a group-wise InfoNCE over the completions' mean token
log-probabilities, after ConSPO (arXiv 2605.12969); localrl's version is the closest well-defined one, named as
such there. Everything else (sampling, advantages, clipping, KL, resume) is GRPO's, over any sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

from localrl.config import check_fields, setting
from localrl.objectives import objectives
from localrl.objectives.grpo import GRPO
from localrl.policy.contrastive import Contrast


@dataclass
class ContrastiveSettings:
    """GRPO with ConSPO's group-wise InfoNCE term"""

    contrastive_coef: float = setting(1.0, "objective contrastive_grpo: weight of the group-wise InfoNCE term (each "
                                           "group's above-mean completions against its below-mean ones) beside GRPO's "
                                           "loss")
    contrastive_temperature: float = setting(0.1, "objective contrastive_grpo: temperature of the InfoNCE softmax "
                                                  "over the completions' mean token log-probabilities")
    contrastive_margin: float = setting(0.0, "objective contrastive_grpo: the margin a positive's score must clear, "
                                             "ramped linearly from 0 to this over the run")


@objectives.register("contrastive_grpo")
class ContrastiveGRPO(GRPO):
    about = "GRPO plus ConSPO's group-wise InfoNCE term"
    settings = ContrastiveSettings

    @staticmethod
    def check_settings(cfg) -> None:
        check_fields(cfg, [
            ("contrastive_coef", cfg.contrastive_coef >= 0, "must be at least 0"),
            ("contrastive_temperature", cfg.contrastive_temperature > 0, "must be positive"),
            ("contrastive_margin", cfg.contrastive_margin >= 0, "must be at least 0"),
        ])

    @staticmethod
    def check_selected(cfg) -> None:
        check_fields(cfg, [("markovian_chunk", cfg.markovian_chunk == 0, "objective contrastive_grpo contrasts "
                            "whole completions; a Markovian trace's rows are its chunks")])

    def update_terms(self, step: int, batch) -> dict:
        return {"contrast": Contrast.at(self.cfg, step)}

    def summary(self, record: dict) -> str:
        line = super().summary(record)
        return line if record.get("contrastive") is None else f"{line}  contrast {record['contrastive']:.3f}"
