"""``localrl bench approvals``: an agent works with a scripted person whose edits follow a hidden rule; the
sessions are recorded and learned from; before and after on held-out tasks (localrl.benchmarks.approvals)."""

from __future__ import annotations

import argparse
from pathlib import Path

from localrl.commands.bench import check_model, json_flag, print_json
from localrl.errors import UserError

LEARNING = {"rpo": "RPO (DPO + the chosen's NLL) for {steps} steps on the sessions' edits",
            "rl": "GRPO for {steps} steps in the shell against the person learned from the sessions' edits",
            "sft": "sft for {steps} steps on the expert's solutions as the person learned from the edits writes them",
            "harness": "proposals revised as the sessions' edits would (no training)"}


def add_parser(benches) -> None:
    p = benches.add_parser("approvals", help="learning a person's rule from recorded approvals: first proposals "
                           "approved and task success, before and after")
    p.add_argument("--model", default="tiny-shell", help="the agent (default tiny-shell)")
    p.add_argument("--rule", default="timeout", choices=["timeout", "long-options"], help="the scripted person's "
                   "hidden rule (default timeout: every command under `timeout 10`; long-options: `wc --lines`, "
                   "never `wc -l`)")
    p.add_argument("--sessions", type=int, default=200, help="sessions recorded with the scripted person "
                   "(default 200)")
    p.add_argument("--held-out", type=int, default=100, help="held-out tasks measured before and after "
                   "(default 100)")
    p.add_argument("--learn", default="rpo", choices=list(LEARNING), help="how the agent learns from the sessions "
                   "(default rpo: DPO + NLL on the edits; rl: GRPO in the shell against the person learned from the "
                   "edits, env shell_person; sft: the expert's solutions in the learned person's form; harness: no "
                   "training, proposals revised as the edits would)")
    p.add_argument("--steps", type=int, default=None, help="training steps on the recorded sessions (default 15; "
                   "30 for rl)")
    p.add_argument("--out", default=None, help="where the sessions and the trained run are kept (default: a new "
                   "temporary directory)")
    json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import tempfile

    from localrl.benchmarks.approvals import bench_approvals

    steps = args.steps if args.steps is not None else 30 if args.learn == "rl" else 15
    if args.sessions < 1 or args.held_out < 1 or steps < 1:
        raise UserError("bench approvals: need --sessions, --held-out and --steps >= 1")
    if args.out and Path(args.out).exists() and (not Path(args.out).is_dir() or any(Path(args.out).iterdir())):
        raise UserError(f"bench approvals --out {args.out}: not an empty directory (its sessions would mix with "
                        f"new ones)")
    out = args.out or tempfile.mkdtemp(prefix="localrl-approvals-")
    check_model(args.model)
    print(f"approvals benchmark: {args.model} works with a scripted person (rule: {args.rule}; a command it breaks "
          f"is edited to the allowed form) on {args.sessions} training tasks, recorded; "
          f"{LEARNING[args.learn].format(steps=steps)}; before and after on {args.held_out} held-out tasks; kept in "
          f"{out}")
    result = bench_approvals(args.model, out, args.rule, sessions=args.sessions, held_out=args.held_out,
                             learn=args.learn, steps=steps)
    print_json(args, result)
    return 0
