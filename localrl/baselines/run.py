"""``localrl baselines pong``: every agent on the same Pong, the same observations and the same
number of environment steps; point win rates with 95% confidence intervals; learning curves.

Protocol, per agent and seed: train for ``steps`` environment steps (a vector step of E envs
counts E), then play greedily until ``eval_points`` points are over, on evaluation games
seeded apart from training. The references (a random policy, the ball tracker) are only
evaluated. The confidence interval of a win rate is a two-level bootstrap (seeds, then the
points within each seed), so it carries both the seed-to-seed spread and the point noise.
PPO and PC+Hebbian are compared by the bootstrap distribution of their difference: they
count as equivalent within 5 points when its 90% interval lies inside [-5, +5] (two one-sided
tests at 5%).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from localrl.atomic import write_text_atomic
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


QUICK = PongBenchConfig(steps=1_000_000, seeds=3, eval_points=2000)

LEARNERS: dict[str, Callable] = {
    "PPO": lambda cfg, seed: PPOAgent(6, 3, cfg.num_envs, seed),
    "PC+Hebbian": lambda cfg, seed: PCHebbianAgent(6, 3, cfg.num_envs, seed, cfg.steps // cfg.num_envs),
    "PC+Hebbian, scalar TD (N=1)": lambda cfg, seed: PCHebbianAgent(
        6, 3, cfg.num_envs, seed, cfg.steps // cfg.num_envs, PCConfig(n_channels=1)),
    "PC+Hebbian, frozen random encoder": lambda cfg, seed: PCHebbianAgent(
        6, 3, cfg.num_envs, seed, cfg.steps // cfg.num_envs, PCConfig(learn_encoder=False)),
}


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


def run(cfg: PongBenchConfig, out: Path, log=print) -> dict:
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
    for name, make in LEARNERS.items():
        per_seed, curves, t0 = [], [], time.time()
        for seed in range(cfg.seeds):
            agent = make(cfg, seed)
            curves.append(train(agent, cfg, seed))
            per_seed.append(evaluate(lambda o: agent.act(o, greedy=True), cfg, seed))
            log(f"{name} seed {seed}: {per_seed[-1].mean():.1%} ({time.time() - t0:.0f} s)")
        results[name] = {"per_seed": per_seed, "curves": curves, "seconds": time.time() - t0}
    summary = summarise(results, rng)
    summary["config"] = asdict(cfg)
    summary["seconds"] = round(time.time() - t_all, 1)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(summary, indent=1))
    write_text_atomic(out / "results.md", table(summary))
    plot_curves(results, summary, out / "learning_curves.png")
    return summary


def summarise(results: dict, rng: np.random.Generator) -> dict:
    rows, boot = {}, {}
    for name, r in results.items():
        boot[name] = bootstrap_rates(r["per_seed"], rng)
        lo, hi = np.percentile(boot[name], [2.5, 97.5])
        rows[name] = {"win_rate": float(np.mean([s.mean() for s in r["per_seed"]])), "ci95": [float(lo), float(hi)],
                      "per_seed": [float(s.mean()) for s in r["per_seed"]],
                      "points": int(sum(len(s) for s in r["per_seed"])), "train_seconds": round(r["seconds"], 1),
                      "curves": r["curves"]}
    diff = boot["PC+Hebbian"] - boot["PPO"]
    lo90, hi90 = np.percentile(diff, [5, 95])
    lo95, hi95 = np.percentile(diff, [2.5, 97.5])
    comparison = {"pc_minus_ppo": float(rows["PC+Hebbian"]["win_rate"] - rows["PPO"]["win_rate"]),
                  "ci95": [float(lo95), float(hi95)], "ci90": [float(lo90), float(hi90)],
                  "equivalent_within_5_points": bool(lo90 > -0.05 and hi90 < 0.05)}
    return {"agents": rows, "comparison": comparison}


def table(summary: dict) -> str:
    c = summary["config"]
    lines = [f"Pong point win rate: {c['steps']:,} training env steps per agent and seed, {c['seeds']} seeds, "
             f"{c['eval_points']:,} evaluation points per seed (opponent skill {c['opponent_skill']}, "
             f"reaction delay {c['reaction_delay']}); {summary['seconds']:.0f} s in all.", "",
             "| agent | win rate | 95% CI | per seed | train s |", "|---|---|---|---|---|"]
    for name, r in summary["agents"].items():
        seeds = " ".join(f"{x:.1%}" for x in r["per_seed"])
        lines.append(f"| {name} | {r['win_rate']:.1%} | {r['ci95'][0]:.1%} - {r['ci95'][1]:.1%} | {seeds} | "
                     f"{r['train_seconds']:.0f} |")
    d = summary["comparison"]
    lines += ["", f"PC+Hebbian minus PPO: {100 * d['pc_minus_ppo']:+.1f} points (95% CI {100 * d['ci95'][0]:+.1f} to "
              f"{100 * d['ci95'][1]:+.1f}); equivalent within 5 points (90% CI inside +-5): "
              f"{'yes' if d['equivalent_within_5_points'] else 'no'}."]
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
