"""Direct preference optimisation as an objective: each step takes one pair of completions of each of its prompts,
the chosen and the rejected, and one AdamW step on their DPO loss against the reference (the base with the adapter
off: no second copy; with ``sync_ref_model``, TR-DPO's moving reference). The maths is ``localrl.policy.dpo``.

Where the pairs come from is the sampler's, so one objective is both of TRL's trainers:

- offline (TRL's ``DPOTrainer``): ``--sampler preferences`` reads ``{prompt, chosen, rejected}`` rows (a file, or
  the built-in task's right and wrong worked answers); each row is a group of two, chosen first;
- online (TRL's ``OnlineDPOTrainer``, generalised from two completions to a group): any other sampler's groups,
  scored by the run's rewards; each group's best completion is chosen over its worst, and a group whose
  completions all scored alike is left out (no preference to learn). A step with no pair left updates nothing.

Its state through a run (checkpointed): the reference (moved only by ``sync_ref_model``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from localrl.config import check_fields, setting
from localrl.memory import peak_memory_mb
from localrl.objectives import Objective, StepContext, objectives, step_record
from localrl.policy.dpo import DPO_LOSS_TYPES, dpo_update, loss_terms, preference_pairs
from localrl.policy.grpo import batch_plan
from localrl.policy.reference import Reference


@dataclass
class DPOSettings:
    """TRL's DPOConfig names; beta and loss_type are the shared fields, set by its preset"""

    label_smoothing: float = setting(0.0, "objective dpo, loss_type robust: the assumed share of preference labels "
                                          "that are flipped (0 to 0.5)")
    loss_weights: str = setting("", "objective dpo: comma-separated weight of each loss in loss_type (empty: 1 each), "
                                    "e.g. loss_type sigmoid,sft with loss_weights 1,0.5")


@objectives.register("dpo")
class DPO(Objective):
    about = ("direct preference optimisation: offline pairs (sampler preferences) or online, each group's best over "
             "its worst")
    rows_per_prompt = 2  # a pair a prompt
    loss_types = DPO_LOSS_TYPES
    combines_losses = True  # loss_type may name several, weighted by loss_weights (TRL's list)
    takes_pairs = True
    preset = {"beta": 0.1, "loss_type": "sigmoid"}  # TRL's DPOConfig defaults
    settings = DPOSettings

    @staticmethod
    def check_settings(cfg) -> None:
        check_fields(cfg, [("label_smoothing", 0 <= cfg.label_smoothing < 0.5, "must be in [0, 0.5)")])

    @staticmethod
    def check_selected(cfg) -> None:
        named = [n.strip() for n in cfg.loss_type.split(",")]
        try:
            loss_terms(cfg.loss_type, cfg.loss_weights)
            weights_wrong = ""
        except ValueError as e:
            weights_wrong = str(e)
        check_fields(cfg, [
            ("label_smoothing", cfg.label_smoothing == 0 or "robust" in named,
             "applies to objective dpo with loss_type robust only"),
            ("loss_weights", not weights_wrong, weights_wrong),
            ("loss_type", len(set(named)) == len(named), "names a loss twice"),
            ("beta", cfg.beta > 0, "objective dpo: must be positive (DPO's beta scales the log-ratios)"),
            ("markovian_chunk", cfg.markovian_chunk == 0,
             "objective dpo pairs whole completions; a Markovian trace's rows are its chunks"),
        ])

    def check(self, w) -> None:
        w.one_process("objective", "dpo")

    def setup(self, ctx: StepContext, state: dict) -> None:
        self.reference = Reference(state.get("reference"))

    def step(self, ctx: StepContext, step: int, tokens: int) -> dict:
        t0 = time.time()
        batch = ctx.sampler.sample(ctx, step, tokens, self.system)
        rewards = batch.rewards if batch.train_rewards is None else batch.train_rewards
        pairs, tied = preference_pairs(batch.rollout, rewards)
        groups = rewards.numel() // batch.rollout.group_size
        micro_batch = None
        if pairs is None:  # every group tied: no preference to learn, and no step (Adam's momentum alone moves it)
            stats = {"loss": 0.0}
        else:
            micro_batch, logits_chunk = batch_plan(ctx.model, pairs, self.cfg, step, ctx.budget)
            stats = dpo_update(ctx.model, ctx.optimizer, pairs, self.cfg, micro_batch, logits_chunk, self.reference)
        rows = 0 if pairs is None else pairs.completion_ids.size(0)
        stats.update(frac_reward_zero_std=tied / max(groups, 1), micro_batch=micro_batch or rows)
        lr = ctx.optimizer.param_groups[0]["lr"]
        if batch.names:  # sampled and scored completions (online): the record of any sampling step
            record = step_record(step, batch.rewards, batch.scores, batch.names, stats, batch.lengths,
                                 batch.truncated, t0, batch.gen_s, lr, ctx.device)
        else:  # a file's pairs: nothing sampled
            elapsed = time.time() - t0
            record = {"kind": "train", "step": step + 1, "loss": stats["loss"],
                      "completion_len": sum(batch.lengths) / max(len(batch.lengths), 1),
                      "tokens_per_s": sum(batch.lengths) / max(elapsed, 1e-9), "step_s": round(elapsed, 3),
                      "lr": lr, "micro_batch": stats["micro_batch"], "peak_mem_mb": peak_memory_mb(ctx.device)}
        dpo = {k: stats[k] for k in ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")
               if k in stats}
        return {**record, "objective": "dpo", "pairs": rows // 2, **dpo, **batch.extra}

    def after_step(self, ctx: StepContext, step: int, record: dict) -> None:
        if self.reference.on_schedule(ctx.model, ctx.optimizer, self.cfg, step):
            record["ref_synced"] = True

    def state(self) -> dict:
        return {"reference": self.reference.state}

    def summary(self, record: dict) -> str:
        dpo = "no pairs" if "reward_margin" not in record else \
            f"margin {record['reward_margin']:.3f}  pairs right {record['reward_accuracy']:.0%}"
        sampled = f"  reward {record['reward_mean']:.3f}  acc {record['accuracy']:.1%}" if "reward_mean" in record \
            else ""
        return f"loss {record['loss']:.4f}  {dpo}{sampled}"

