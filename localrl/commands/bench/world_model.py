"""``localrl bench world``: a world model as the shell, against the real sandbox, on held-out tasks
(localrl.evaluation.world_fidelity)."""

from __future__ import annotations

import argparse

from localrl.commands.bench import json_flag, print_json
from localrl.errors import UserError


def add_parser(benches) -> None:
    p = benches.add_parser("world", help="a world model standing in for the shell: its outputs against the real "
                           "sandbox's, exact matches")
    p.add_argument("--model", default="tiny-shell-world", help="the world model, as env world:SOURCE names it "
                   "(default tiny-shell-world)")
    p.add_argument("--held-out", type=int, default=100, help="held-out tasks it is measured on (default 100)")
    json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time

    from localrl.config import TrainConfig
    from localrl.envs.shell_tasks import held_out_tasks
    from localrl.envs.world_models import open_world_model
    from localrl.evaluation.world_fidelity import fidelity, format_fidelity
    from localrl.generation.endpoint import EndpointSettings

    if args.held_out < 1:
        raise UserError("bench world: need --held-out >= 1")
    # before the banner: a world model that is not there is one line
    world = open_world_model(args.model, EndpointSettings.of(TrainConfig()), f"bench world --model {args.model}")
    print(f"world benchmark: {args.model} as the shell, against the real sandbox, on {args.held_out} held-out tasks "
          f"(names never seen), each played by the scripted expert and the careless one; exact matches")
    t0 = time.monotonic()
    try:
        result = fidelity(world, held_out_tasks(args.held_out))
    finally:
        world.close()
    print(format_fidelity(result))
    print(f"{time.monotonic() - t0:.1f} s")
    print_json(args, result)
    return 0
