"""``localrl bench agent-step``: one multi-turn GRPO step on the shell environment, timed by part
(localrl.benchmarks.agent_step)."""

from __future__ import annotations

import argparse

from localrl.commands.bench import check_model, json_flag, print_json, repeats_flag, size_flags, sizes
from localrl.errors import UserError


def add_parser(benches) -> None:
    p = benches.add_parser("agent-step", help="one multi-turn GRPO step of an agent: decoding against sandboxed "
                           "commands, then the update's two forwards")
    p.add_argument("--model", default="tiny-shell", help="the agent (default tiny-shell)")
    size_flags(p, prompts="2 tasks", group="8 episodes a task")
    repeats_flag(p, "timed updates (median reported)")
    json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from localrl.benchmarks.agent_step import bench_agent_step

    b, g = sizes(args, prompts=2, group=8)
    if b < 1 or g < 2 or args.repeats < 1:
        raise UserError("bench agent-step: need --prompts >= 1, --group >= 2 and --repeats >= 1")
    check_model(args.model)
    print(f"agent-step benchmark: one multi-turn GRPO step of {args.model} on the shell environment, {b} "
          f"tasks x G={g} episodes, cpu; update timed as the median of {args.repeats}")
    print_json(args, bench_agent_step(args.model, b, g, repeats=args.repeats))
    return 0
