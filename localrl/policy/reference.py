"""The KL reference policy, and its sync with the policy (TR-DPO's mixup, the prolonged-RL resets).

Without sync the reference is the base model: the same network with the adapter switched off,
never a second copy. With ``sync_ref_model`` the reference becomes an adapter state of its own,
every ``ref_model_sync_steps`` steps mixed from the policy's LoRA weights:
``ref = alpha * policy + (1 - alpha) * ref``; the reference's log-probabilities come from the
same network with those weights swapped in for the forward. The base counts as the policy's
factor A with a zero factor B, so the first sync is the exact mixture of the base and the
policy; later ones mix the factors, which is the mixture of the weights only for ``alpha = 1``
(a hard reset of the reference to the policy).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def lora_state(model) -> dict[str, torch.Tensor]:
    """A copy of the adapter's trainable weights."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


class Reference:
    """The reference policy of a run: the base until the first sync, then ``state`` (adapter weights)."""

    def __init__(self, state: dict[str, torch.Tensor] | None = None):
        self.state = state

    def sync(self, model, alpha: float) -> None:
        """Mix the policy's adapter into the reference: ``alpha`` of the policy, the rest of the reference."""
        policy = lora_state(model)
        if self.state is None:  # the base: the policy's A with a zero B
            self.state = {name: w if "lora_A" in name else torch.zeros_like(w) for name, w in policy.items()}
        self.state = {name: alpha * policy[name] + (1.0 - alpha) * self.state[name] for name in policy}

    def on_schedule(self, model, optimizer, cfg, step: int) -> bool:
        """After 0-based ``step``: with ``sync_ref_model``, sync every ``ref_model_sync_steps`` steps (and clear AdamW's
        moments with ``reset_optimizer_on_sync``); whether it synced."""
        if not cfg.sync_ref_model or (step + 1) % cfg.ref_model_sync_steps:
            return False
        self.sync(model, cfg.ref_model_mixup_alpha)
        if cfg.reset_optimizer_on_sync:
            optimizer.state.clear()
        return True

    def forward_context(self, model):
        """A context in which ``model`` computes the reference's log-probabilities."""
        return model.disable_adapter() if self.state is None else _swapped(model, self.state)


@contextmanager
def _swapped(model, state: dict[str, torch.Tensor]):
    params = {name: p for name, p in model.named_parameters() if name in state}
    saved = {name: p.detach().clone() for name, p in params.items()}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])
    try:
        yield
    finally:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(saved[name])
