"""The mathematics of the updates: the GRPO loss family (TRL-checked), the GRPO update with its shared-prompt
forward and KL reference, the supervised NLL step, and the experience library of training-free GRPO. Pure
functions of tensors and rollouts; the objectives in ``localrl.objectives`` decide when to call them."""
