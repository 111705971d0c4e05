"""PPO with a learned critic as an objective (the maths and the update are ``localrl.policy.ppo``): each step samples
a scored batch through the configured sampler (prompt completions, or an environment's episodes, whose trained
tokens are the agent's own), then runs ``ppo_update`` (its ratios start from the policy's own log-probabilities of
the sampled tokens, so where llama.cpp sampled, rollout_is's correction is not applied): per-token rewards (the score on the last trained token,
``-kl_coef`` x KL on each), GAE over the trained tokens, whitened advantages, ``num_ppo_epochs`` x
``num_mini_batches`` steps of the clipped policy loss and the clipped value loss.

Its state through a run (checkpointed): the critic (a linear head on the policy's last hidden state) and its AdamW
moments, and the KL reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from localrl.config import check_fields, setting
from localrl.objectives import Objective, StepContext, objectives, step_record
from localrl.policy.grpo import batch_plan
from localrl.policy.losses import flat_group_share
from localrl.policy.ppo import Critic, ppo_update
from localrl.policy.reference import Reference


@dataclass
class PPOSettings:
    """PPO with a critic; TRL's PPOConfig names and defaults"""

    num_ppo_epochs: int = setting(4, "objective ppo: passes over each step's rollouts")
    num_mini_batches: int = setting(1, "objective ppo: optimizer steps per pass, each on a share of the groups")
    gamma: float = setting(1.0, "objective ppo: discount of GAE, per trained token")
    lam: float = setting(0.95, "objective ppo: GAE's lambda")
    cliprange_value: float = setting(0.2, "objective ppo: how far a value may move from the rollout's before the "
                                          "value loss clips it")
    vf_coef: float = setting(0.1, "objective ppo: weight of the value loss")
    kl_coef: float = setting(0.05, "objective ppo: per-token KL to the reference, subtracted from the reward (beta "
                                   "adds KL to the loss instead)")
    kl_estimator: str = setting("k1", "objective ppo: the per-token KL in the reward: k1 (log ratio) or k3")


@objectives.register("ppo")
class PPO(Objective):
    about = "PPO with a learned critic: GAE over the trained tokens, TRL's PPOConfig names"
    preset = {"beta": 0.0}  # the KL is in the reward (kl_coef), as in TRL's PPO; beta adds it to the loss too
    settings = PPOSettings

    @staticmethod
    def check_selected(cfg) -> None:
        check_fields(cfg, [("objective", not cfg.markovian_chunk, "ppo is not for markovian_chunk")])

    @staticmethod
    def check_settings(cfg) -> None:
        check_fields(cfg, [
            ("num_ppo_epochs", cfg.num_ppo_epochs >= 1, "must be at least 1"),
            ("num_mini_batches", cfg.num_mini_batches >= 1, "must be at least 1"),
            ("num_mini_batches", cfg.num_mini_batches <= cfg.prompts_per_step,
             f"must be at most prompts_per_step ({cfg.prompts_per_step}): a mini-batch holds whole groups"),
            ("gamma", 0 <= cfg.gamma <= 1, "must be in [0, 1]"),
            ("lam", 0 <= cfg.lam <= 1, "must be in [0, 1]"),
            ("cliprange_value", cfg.cliprange_value > 0, "must be positive"),
            ("vf_coef", cfg.vf_coef >= 0, "must be non-negative"),
            ("kl_coef", cfg.kl_coef >= 0, "must be non-negative"),
            ("kl_estimator", cfg.kl_estimator in ("k1", "k3"), "must be k1 or k3"),
        ])

    def check(self, w) -> None:
        w.one_process("objective", "ppo")

    def setup(self, ctx: StepContext, state: dict) -> None:
        self.reference = Reference(state.get("reference"))
        hidden = ctx.model.config.hidden_size if hasattr(ctx.model.config, "hidden_size") else \
            ctx.model.get_input_embeddings().embedding_dim
        self.critic = Critic(hidden).to(ctx.device)
        self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=self.cfg.lr,
                                                  weight_decay=self.cfg.weight_decay)
        if "critic" in state:  # the critic and its moments as the checkpoint's step left them
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])

    def step(self, ctx: StepContext, step: int, tokens: int) -> dict:
        t0 = time.time()
        batch = ctx.sampler.sample(ctx, step, tokens, self.system)
        scores = batch.rewards if batch.train_rewards is None else batch.train_rewards
        if batch.reward_rows is not None:
            scores = scores[batch.reward_rows]
        ctx.model.train()
        micro_batch, logits_chunk = batch_plan(ctx.model, batch.rollout, self.cfg, step, ctx.budget)
        stats = ppo_update(ctx.model, self.critic, ctx.optimizer, self.critic_optimizer, batch.rollout,
                           scores.float(), self.cfg, micro_batch, logits_chunk, self.reference)
        stats.update(frac_reward_zero_std=flat_group_share(batch.rewards, self.cfg.group_size),
                     micro_batch=micro_batch or batch.rollout.completion_ids.size(0))
        record = step_record(step, batch.rewards, batch.scores, batch.names, stats, batch.lengths, batch.truncated,
                             t0, batch.gen_s, ctx.optimizer.param_groups[0]["lr"], ctx.device)
        extra = {k: stats[k] for k in ("pg_loss", "vf_loss", "vf_clip_frac", "value_mean", "return_mean")}
        return {**record, **extra, **batch.extra}

    def state(self) -> dict:
        return {"reference": self.reference.state, "critic": self.critic.state_dict(),
                "critic_optimizer": self.critic_optimizer.state_dict()}
