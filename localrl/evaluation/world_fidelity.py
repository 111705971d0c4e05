"""How faithful a world model of the shell is: its answers against the real sandbox's, on the same commands.

Each task is played twice in the real sandbox, by the scripted expert and by the careless one (``ShellTask.slip``),
and the same episode is played in the world model (``WorldEnv``). Per family:

- ``output``: the share of commands whose output the world model predicts exactly, asked about the real files
  (one step, from the truth);
- ``files``: the same for the files after the command;
- ``final_files``: the share of episodes whose final files, the world model's own chained beliefs, are exactly
  the real ones;
- ``reward``: the share of episodes the simulation scores as the sandbox does (with the answer each side's last
  output gives): the agreement an agent trained in the simulation is rewarded by;
- ``overrated``: the share it scores higher than the sandbox (what an agent trained in it could learn to exploit:
  commands the world model accepts that fail in reality), ``underrated``: lower (right work it does not reward).
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from localrl.envs.shell import ShellEnv, expert_call, solve, task_list
from localrl.envs.world import Warner, WorldEnv
from localrl.envs.world_format import WorldReplyError, apply, parse_answer, read_tree
from localrl.envs.world_models import WorldModel

MEASURES = ("output", "files", "final_files", "reward", "overrated", "underrated")


def fidelity(world: WorldModel, tasks, isolation: str | None = None, workers: int = 16) -> dict:
    """{family: {measure: share, "commands": n, "episodes": n}} and "all"; tasks are played ``workers`` at a time
    (so a torch world model answers them in batches)."""
    warn = Warner(world.name)  # the first unreadable reply of the whole measurement, not one a task
    with ThreadPoolExecutor(max_workers=workers) as pool:
        played = list(pool.map(lambda i: _play(world, tasks, i, isolation, warn), range(len(tasks))))
    hits: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    everything: dict[str, list[bool]] = defaultdict(list)
    for task, measures in zip(tasks, played):
        for k, v in measures.items():
            hits[task.family][k] += v
            everything[k] += v
    return {**{family: _shares(m) for family, m in sorted(hits.items())}, "all": _shares(everything)}


def _play(world: WorldModel, tasks, i: int, isolation: str | None, warn: Warner) -> dict[str, list[bool]]:
    """Task ``i``'s measures, both solutions."""
    task, got = tasks[i], defaultdict(list)
    real = ShellEnv(task_list(tasks), max_turns=16, isolation=isolation)
    sim = WorldEnv(world, task_list(tasks), 16, warn)
    try:
        for slip in (False, True):
            commands = task.slip if slip else task.solution
            if not commands:
                continue
            real.reset(i)
            for command in commands:  # one step from the real files
                before = read_tree(real.workdir)
                observation, _ = real.step(expert_call(command))
                reply = world.ask(before, command)
                try:
                    predicted, written, removed = parse_answer(reply) if reply is not None else (None, None, [])
                except WorldReplyError:
                    predicted, written, removed = None, None, []
                got["output"].append(predicted == observation)
                got["files"].append(written is not None and apply(before, written, removed) == read_tree(real.workdir))
            real_reward, _ = solve(real, i, slip)
            sim_reward, _ = solve(sim, i, slip)
            got["final_files"].append(sim.tree == read_tree(real.workdir))
            got["reward"].append(sim_reward == real_reward)
            got["overrated"].append(sim_reward > real_reward)
            got["underrated"].append(sim_reward < real_reward)
    finally:
        real.close()
    return got


def _shares(measures: dict[str, list[bool]]) -> dict:
    return {**{k: sum(measures[k]) / max(len(measures[k]), 1) for k in MEASURES},
            "commands": len(measures["output"]), "episodes": len(measures["reward"])}


def format_fidelity(result: dict) -> str:
    """The table, one family a row."""
    rows = [f"{'family':8} {'output':>7} {'files':>7} {'final files':>12} {'reward':>7} {'over':>6} {'under':>6} "
            f"{'commands':>9} {'episodes':>9}"]
    for family, r in result.items():
        rows.append(f"{family:8} {r['output']:7.1%} {r['files']:7.1%} {r['final_files']:12.1%} {r['reward']:7.1%} "
                    f"{r['overrated']:6.1%} {r['underrated']:6.1%} {r['commands']:9d} {r['episodes']:9d}")
    return "\n".join(rows)
