"""One rank of ``test_distributed.py``'s update check, launched by torchrun (not collected by pytest).

    torchrun --nproc-per-node 2 tests/distributed_worker.py CASES.pt OUT_DIR

For each case in CASES.pt (a config, and per rank a rollout with its rewards), this rank loads
the policy as the trainer does, runs ``grpo.update`` on its own rollout, and saves its LoRA
gradients (after the all-reduce) and its adapter weights to OUT_DIR/case-I-rank-R.pt.
"""

import sys

import torch

from localrl.distributed import init_from_env, shutdown
from localrl.modeling import load_policy
from localrl.policy.grpo import update


def main(cases_path: str, out_dir: str) -> None:
    w = init_from_env()
    cases = torch.load(cases_path, weights_only=False)
    for i, case in enumerate(cases):
        cfg = case["cfg"]
        torch.manual_seed(cfg.seed)
        model, _ = load_policy(cfg, torch.device("cpu"), in_4bit=False)
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        optimizer = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        rollout, rewards = case["rollouts"][w.rank], case["rewards"][w.rank]
        stats = update(model, optimizer, rollout, rewards, cfg, 0)
        torch.save({"grads": {n: p.grad for n, p in params.items()}, "weights": {n: p.detach() for n, p in params.items()},
                    "stats": stats}, f"{out_dir}/case-{i}-rank-{w.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
