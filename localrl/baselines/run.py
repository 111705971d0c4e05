"""``localrl baselines pong``: every agent on the same Pong, the same observations and the same
number of environment steps; point win rates with 95% confidence intervals; learning curves.

Protocol, per agent and seed: train for ``steps`` environment steps (a vector step of E envs
counts E), then play greedily until ``eval_points`` points are over, on evaluation games
seeded apart from training. The references (a random policy, the ball tracker) are only
evaluated. The confidence interval of a win rate is a two-level bootstrap (seeds, then the
points within each seed), so it carries both the seed-to-seed spread and the point noise.
Each learner is compared with PPO (and the two JEPA priors with each other) by the bootstrap
distribution of their difference: they count as equivalent within 5 points when its 90% interval
lies inside [-5, +5] (two one-sided tests at 5%).

Every (learner, seed) run is independent and seeded, so they run side by side on as many
processes as there are cores, and give the same numbers on one.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from localrl.atomic import write_text_atomic
from localrl.baselines.jepa import JEPAAgent, JEPAConfig
from localrl.baselines.pc_hebbian import PCConfig, PCHebbianAgent
from localrl.baselines.pong import VectorPong, tracker_policy
from localrl.baselines.ppo import PPOAgent


@dataclass
class PongBenchConfig:
    steps: int = 3_000_000  # environment steps per agent and seed
    seeds: int = 5
    eval_points: int = 5000  # points played in evaluation, per agent and seed
    num_envs: int = 16
    opponent_skill: float = 0.8
    reaction_delay: int = 1
    curve_windows: int = 20  # learning-curve points per run
    agents: tuple[str, ...] = ()  # optional families trained beside the default ones (OPTIONAL)


QUICK = PongBenchConfig(steps=500_000, seeds=3, eval_points=2000)


def _jepa(prior: str) -> Callable:
    def make(cfg: PongBenchConfig, seed: int) -> JEPAAgent:
        return JEPAAgent(6, 3, cfg.num_envs, seed, cfg.steps // cfg.num_envs, JEPAConfig(prior=prior))
    return make


# name: (family, factory). The reference of every comparison, PPO, comes first.
LEARNERS: dict[str, tuple[str, Callable]] = {
    "PPO": ("ppo", lambda cfg, seed: PPOAgent(6, 3, cfg.num_envs, seed)),
    "PC+Hebbian": ("pc-hebbian", lambda cfg, seed: PCHebbianAgent(6, 3, cfg.num_envs, seed, cfg.steps // cfg.num_envs)),
    "PC+Hebbian, scalar TD (N=1)": ("pc-hebbian", lambda cfg, seed: PCHebbianAgent(
        6, 3, cfg.num_envs, seed, cfg.steps // cfg.num_envs, PCConfig(n_channels=1))),
    "PC+Hebbian, frozen random encoder": ("pc-hebbian", lambda cfg, seed: PCHebbianAgent(
        6, 3, cfg.num_envs, seed, cfg.steps // cfg.num_envs, PCConfig(learn_encoder=False))),
    "JEPA world model, subspace prior (Sub-JEPA)": ("jepa", _jepa("subspace")),
    "JEPA world model, full-latent prior (LeWM)": ("jepa", _jepa("full")),
}
OPTIONAL = ("jepa",)  # families trained only when asked for (--agent)
# (a, b): a minus b, each with its bootstrap interval
COMPARISONS = [("PC+Hebbian", "PPO"), ("JEPA world model, subspace prior (Sub-JEPA)", "PPO"),
               ("JEPA world model, full-latent prior (LeWM)", "PPO"),
               ("JEPA world model, subspace prior (Sub-JEPA)", "JEPA world model, full-latent prior (LeWM)")]


def learners(cfg: PongBenchConfig) -> list[str]:
    return [name for name, (family, _) in LEARNERS.items() if family not in OPTIONAL or family in cfg.agents]


def _env(cfg: PongBenchConfig, seed: int, num_envs: int | None = None) -> VectorPong:
    return VectorPong(num_envs or cfg.num_envs, cfg.opponent_skill, cfg.reaction_delay, seed=seed)


def train(agent, cfg: PongBenchConfig, seed: int) -> list[tuple[int, float]]:
    """Train for ``cfg.steps`` env steps; returns (env steps, win rate of the points in that window)."""
    env = _env(cfg, seed)
    obs, _ = env.reset(seed=seed)
    vector_steps = cfg.steps // cfg.num_envs
    window = max(1, vector_steps // cfg.curve_windows)
    curve, won, lost = [], 0, 0
    for t in range(1, vector_steps + 1):
        actions = agent.act(obs)
        next_obs, reward, terminated, truncated, _ = env.step(actions)
        agent.observe(obs, actions, reward, terminated | truncated, next_obs)
        obs = next_obs
        won += int((reward > 0).sum())
        lost += int((reward < 0).sum())
        if t % window == 0:
            curve.append((t * cfg.num_envs, won / max(1, won + lost)))
            won = lost = 0
    return curve


def evaluate(act: Callable[[np.ndarray], np.ndarray], cfg: PongBenchConfig, seed: int) -> np.ndarray:
    """Outcomes (1 won, 0 lost) of the first ``eval_points`` points played by ``act``."""
    env = _env(cfg, 10_000 + seed, 64)
    obs, _ = env.reset(seed=10_000 + seed)
    outcomes: list[np.ndarray] = []
    played = 0
    while played < cfg.eval_points:
        obs, reward, *_ = env.step(act(obs))
        done = reward != 0
        outcomes.append((reward[done] > 0).astype(np.int8))
        played += int(done.sum())
    return np.concatenate(outcomes)[:cfg.eval_points]


def bootstrap_rates(per_seed: list[np.ndarray], rng: np.random.Generator, n: int = 4000) -> np.ndarray:
    """Bootstrap distribution of the pooled win rate: resample seeds, then points within each."""
    k = len(per_seed)
    rates = np.array([s.mean() for s in per_seed])
    sizes = np.array([len(s) for s in per_seed])
    picks = rng.integers(0, k, (n, k))  # [n, k] seeds
    wins = rng.binomial(sizes[picks], rates[picks])  # points re-drawn within each picked seed
    return wins.sum(1) / sizes[picks].sum(1)


def train_and_evaluate(name: str, cfg: PongBenchConfig, seed: int) -> dict:
    """One learner, one seed: its learning curve, its greedy evaluation's outcomes, and what it took."""
    torch.set_num_threads(1)  # tiny networks: threads cost more than they give (and the seeds run side by side)
    t0 = time.time()
    agent = LEARNERS[name][1](cfg, seed)
    curve = train(agent, cfg, seed)
    outcomes = evaluate(lambda o: agent.act(o, greedy=True), cfg, seed)
    extra = {}
    if hasattr(agent, "effective_rank"):  # the latent world models: how many dimensions their latent uses
        extra = {"effective_rank": agent.effective_rank(_states(cfg, seed)), "latent": agent.cfg.latent}
    return {"curve": curve, "outcomes": outcomes, "seconds": time.time() - t0, **extra}


def _states(cfg: PongBenchConfig, seed: int, steps: int = 256) -> np.ndarray:
    """Observations of the tracker's play on evaluation games: the states a latent is measured on."""
    env = _env(cfg, 20_000 + seed)
    obs, _ = env.reset(seed=20_000 + seed)
    seen = []
    for _ in range(steps):
        seen.append(obs)
        obs, *_ = env.step(tracker_policy(obs))
    return np.concatenate(seen)


def _jobs(cfg: PongBenchConfig, workers: int, log) -> dict[tuple[str, int], dict]:
    """Every (learner, seed) run, on ``workers`` processes (each seed's run is the same on any of them)."""
    jobs = [(name, seed) for name in learners(cfg) for seed in range(cfg.seeds)]
    done: dict[tuple[str, int], dict] = {}
    t0 = time.time()

    def report(job, result):
        done[job] = result
        log(f"{job[0]} seed {job[1]}: {result['outcomes'].mean():.1%} ({result['seconds']:.0f} s; "
            f"{len(done)}/{len(jobs)} runs in {time.time() - t0:.0f} s)")

    if workers <= 1:
        for job in jobs:
            report(job, train_and_evaluate(job[0], cfg, job[1]))
        return done
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(train_and_evaluate, name, cfg, seed): (name, seed) for name, seed in jobs}
        for future in as_completed(futures):
            report(futures[future], future.result())
    return done


def run(cfg: PongBenchConfig, out: Path, log=print, workers: int = 1) -> dict:
    rng = np.random.default_rng(0)
    results: dict[str, dict] = {}
    t_all = time.time()
    for name in ["random", "tracker"]:
        per_seed = []
        for seed in range(cfg.seeds):
            policy_rng = np.random.default_rng(seed)
            act = tracker_policy if name == "tracker" else (lambda o, r=policy_rng: r.integers(0, 3, len(o)))
            per_seed.append(evaluate(act, cfg, seed))
        results[name] = {"per_seed": per_seed, "curves": [], "seconds": 0.0}
        log(f"{name}: {np.mean([s.mean() for s in per_seed]):.1%}")
    done = _jobs(cfg, workers, log)
    for name in learners(cfg):
        runs = [done[name, seed] for seed in range(cfg.seeds)]
        results[name] = {"per_seed": [r["outcomes"] for r in runs], "curves": [r["curve"] for r in runs],
                         "seconds": sum(r["seconds"] for r in runs)}
        if "effective_rank" in runs[0]:
            results[name]["effective_rank"] = [r["effective_rank"] for r in runs]
            results[name]["latent"] = runs[0]["latent"]
    summary = summarise(results, rng)
    summary["config"] = asdict(cfg)
    summary["seconds"] = round(time.time() - t_all, 1)
    summary["workers"] = workers
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(summary, indent=1))
    write_text_atomic(out / "results.md", table(summary))
    plot_curves(results, summary, out / "learning_curves.png")
    return summary


def compare(boot: dict[str, np.ndarray], rows: dict, a: str, b: str) -> dict:
    """``a`` minus ``b``: the difference of win rates, its bootstrap intervals, and the equivalence test
    (within 5 points when the 90% interval lies inside [-5, +5]: two one-sided tests at 5%)."""
    diff = boot[a] - boot[b]
    lo90, hi90 = np.percentile(diff, [5, 95])
    lo95, hi95 = np.percentile(diff, [2.5, 97.5])
    return {"a": a, "b": b, "difference": float(rows[a]["win_rate"] - rows[b]["win_rate"]),
            "ci95": [float(lo95), float(hi95)], "ci90": [float(lo90), float(hi90)],
            "equivalent_within_5_points": bool(lo90 > -0.05 and hi90 < 0.05)}


def summarise(results: dict, rng: np.random.Generator) -> dict:
    rows, boot = {}, {}
    for name, r in results.items():
        boot[name] = bootstrap_rates(r["per_seed"], rng)
        lo, hi = np.percentile(boot[name], [2.5, 97.5])
        rows[name] = {"win_rate": float(np.mean([s.mean() for s in r["per_seed"]])), "ci95": [float(lo), float(hi)],
                      "per_seed": [float(s.mean()) for s in r["per_seed"]],
                      "points": int(sum(len(s) for s in r["per_seed"])), "train_seconds": round(r["seconds"], 1),
                      "curves": r["curves"]}
        if "effective_rank" in r:
            rows[name]["effective_rank"] = [round(x, 2) for x in r["effective_rank"]]
            rows[name]["latent"] = r["latent"]
    comparisons = [compare(boot, rows, a, b) for a, b in COMPARISONS if a in rows and b in rows]
    return {"agents": rows, "comparisons": comparisons}


def table(summary: dict) -> str:
    c = summary["config"]
    lines = [f"Pong point win rate: {c['steps']:,} training env steps per agent and seed, {c['seeds']} seeds, "
             f"{c['eval_points']:,} evaluation points per seed (opponent skill {c['opponent_skill']}, "
             f"reaction delay {c['reaction_delay']}); {summary['seconds']:.0f} s in all "
             f"({summary.get('workers', 1)} processes).", "",
             "| agent | win rate | 95% CI | per seed | train s |", "|---|---|---|---|---|"]
    for name, r in summary["agents"].items():
        seeds = " ".join(f"{x:.1%}" for x in r["per_seed"])
        lines.append(f"| {name} | {r['win_rate']:.1%} | {r['ci95'][0]:.1%} - {r['ci95'][1]:.1%} | {seeds} | "
                     f"{r['train_seconds']:.0f} |")
    lines.append("")
    for d in summary["comparisons"]:
        lines.append(f"{d['a']} minus {d['b']}: {100 * d['difference']:+.1f} points (95% CI {100 * d['ci95'][0]:+.1f} "
                     f"to {100 * d['ci95'][1]:+.1f}); equivalent within 5 points (90% CI inside +-5): "
                     f"{'yes' if d['equivalent_within_5_points'] else 'no'}.")
    ranks = [f"{name} {' '.join(f'{x:.1f}' for x in r['effective_rank'])} (of {r['latent']})"
             for name, r in summary["agents"].items() if "effective_rank" in r]
    if ranks:
        lines += ["", "Effective rank of the latent on the tracker's states, per seed: " + "; ".join(ranks) + "."]
    return "\n".join(lines) + "\n"


def plot_curves(results: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    for name, r in results.items():
        if not r["curves"]:
            ax.axhline(summary["agents"][name]["win_rate"], ls="--", lw=1, color="grey" if name == "random" else "k",
                       label=f"{name} (evaluation)")
            continue
        steps = np.array([s for s, _ in r["curves"][0]])
        rates = np.array([[w for _, w in curve] for curve in r["curves"]])  # [seeds, windows]
        line, = ax.plot(steps, rates.mean(0), label=name)
        ax.fill_between(steps, rates.min(0), rates.max(0), color=line.get_color(), alpha=0.15)
    ax.set_xlabel("environment steps")
    ax.set_ylabel("points won while training")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("Pong: mean over seeds (band: min to max)")
    fig.tight_layout()
    tmp = path.with_name(f".tmp-{path.name}")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)
