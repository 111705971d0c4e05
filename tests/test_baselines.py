"""Backprop-free baselines: the parts are checked against what they claim to compute."""

import json

import numpy as np
import pytest
import torch

from localrl.baselines.jepa import GaussianPrior, JEPAAgent, JEPAConfig, Replay, epps_pulley
from localrl.baselines.pc_hebbian import DistributionalTD, PCEncoder, PCHebbianAgent
from localrl.baselines.pong import VectorPong, tracker_policy
from localrl.baselines.ppo import PPOAgent
from localrl.baselines.run import PongBenchConfig, bootstrap_rates, evaluate, train


def _stream(rng, n=256):
    """Observations with structure: points near a few prototypes."""
    protos = rng.normal(size=(4, 6))
    return protos[rng.integers(0, 4, n)] + 0.05 * rng.normal(size=(n, 6))


def test_pc_inference_never_raises_the_energy():
    rng = np.random.default_rng(0)
    enc = PCEncoder(6, 64, rng, steps=50)
    for _ in range(20):  # also after learning has changed the weights
        enc.learn(o := _stream(rng), enc.infer(o))
    energies = []
    enc.infer(_stream(rng), trace=energies)
    energies = np.stack(energies)  # [steps, batch]
    assert (np.diff(energies, axis=0) <= 1e-9).all()
    assert energies[-1].mean() < 0.5 * energies[0].mean()


def test_pc_local_learning_reduces_prediction_error_on_a_fixed_stream():
    rng = np.random.default_rng(1)
    enc = PCEncoder(6, 4, rng)  # as many latents as prototypes: random ones cannot reconstruct them
    stream = _stream(np.random.default_rng(2), 512)

    def error():
        x = enc.infer(stream)
        return float(((stream - x @ enc.W.T - enc.b) ** 2).sum(1).mean())

    before = error()
    for _ in range(200):
        enc.learn(stream, enc.infer(stream))
    assert error() < 0.5 * before


def test_distributional_td_channels_converge_to_the_expectiles():
    """One state, one action, terminal rewards from a known skewed distribution."""
    rng = np.random.default_rng(0)
    td = DistributionalTD(n_features=1, n_actions=1, n_channels=5, num_envs=64, lr=0.02, gamma=0.9, trace_decay=0.0)
    phi = np.ones((64, 1))
    actions = np.zeros(64, dtype=int)
    for _ in range(6000):
        rewards = rng.exponential(1.0, 64)
        td.update(phi, actions, rewards, np.ones(64), phi, actions)
    samples = rng.exponential(1.0, 200_000)
    for tau, value in zip(td.taus, td.w[0, :, 0]):
        # the tau-expectile e solves tau E[(X-e)+] = (1-tau) E[(e-X)+]
        lo, hi = 0.0, 10.0
        for _ in range(60):
            e = (lo + hi) / 2
            gap = tau * np.maximum(samples - e, 0).mean() - (1 - tau) * np.maximum(e - samples, 0).mean()
            lo, hi = (e, hi) if gap > 0 else (lo, e)
        assert value == pytest.approx(e, abs=0.05)
    assert (np.diff(td.w[0, :, 0]) > 0).all()


def test_pc_hebbian_learning_builds_no_gradient_graph(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("autograd used")

    monkeypatch.setattr(torch.Tensor, "backward", forbidden)
    monkeypatch.setattr(torch.autograd, "grad", forbidden)
    monkeypatch.setattr(torch.autograd, "backward", forbidden)
    cfg = PongBenchConfig(steps=2000, num_envs=8)
    agent = PCHebbianAgent(6, 3, 8, seed=0, total_steps=250)
    before = (agent.encoder.W.copy(), agent.td.w.copy())
    with torch.enable_grad():
        train(agent, cfg, seed=0)
    assert not np.allclose(before[0], agent.encoder.W) and not np.allclose(before[1], agent.td.w)
    state = [agent.encoder.W, agent.encoder.b, agent.td.w, agent.td.z]
    assert all(type(a) is np.ndarray for a in state)  # no tensors anywhere, so no graph to build
    import localrl.baselines.pc_hebbian as module
    assert "torch" not in vars(module)


def test_ppo_learns_a_trivial_environment():
    """One step per episode, reward 1 for action 2 and 0 otherwise."""
    n = 32
    agent = PPOAgent(6, 3, n, seed=0)
    obs = np.random.default_rng(0).normal(size=(n, 6)).astype(np.float32)
    for _ in range(64 * 6):
        actions = agent.act(obs)
        rewards = (actions == 2).astype(np.float32)
        agent.observe(obs, actions, rewards, np.ones(n, bool), obs)
    assert (agent.act(obs, greedy=True) == 2).all()


def test_pong_is_deterministic_for_a_seed():
    def play(seed):
        env = VectorPong(8, seed=seed)
        obs, _ = env.reset(seed=seed)
        rng = np.random.default_rng(3)
        trace = []
        for _ in range(500):
            obs, reward, terminated, truncated, _ = env.step(rng.integers(0, 3, 8))
            trace.append((obs.copy(), reward.copy()))
        return trace

    a, b, c = play(5), play(5), play(6)
    assert all((x[0] == y[0]).all() and (x[1] == y[1]).all() for x, y in zip(a, b))
    assert any((x[0] != y[0]).any() for x, y in zip(a, c))
    assert sum(abs(r).sum() for _, r in a) > 0  # points were played


def test_references_bracket_the_game():
    cfg = PongBenchConfig(eval_points=600)
    rng = np.random.default_rng(0)
    random_rate = evaluate(lambda o: rng.integers(0, 3, len(o)), cfg, 0).mean()
    tracker_rate = evaluate(tracker_policy, cfg, 0).mean()
    assert random_rate < 0.2 < 0.6 < tracker_rate


def test_bootstrap_interval_covers_the_pooled_rate_and_shrinks_with_points():
    rng = np.random.default_rng(0)
    small = [rng.random(200) < 0.6 for _ in range(3)]
    large = [rng.random(5000) < 0.6 for _ in range(3)]
    lo_s, hi_s = np.percentile(bootstrap_rates(small, rng), [2.5, 97.5])
    lo_l, hi_l = np.percentile(bootstrap_rates(large, rng), [2.5, 97.5])
    assert lo_l < np.mean([s.mean() for s in large]) < hi_l
    assert hi_l - lo_l < hi_s - lo_s


def test_epps_pulley_is_near_zero_for_a_standard_normal_and_large_for_a_collapse_or_a_wrong_scale():
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(4096, 8, generator=g)
    assert epps_pulley(normal) < 2e-3
    assert epps_pulley(torch.zeros(4096, 8)) > 0.1  # every sample one point: the trivial latent
    assert epps_pulley(3 * normal) > 50 * epps_pulley(normal)


def test_the_subspace_prior_constrains_only_its_subspaces_and_the_full_prior_every_direction():
    cfg = JEPAConfig(prior="subspace", latent=16, subspaces=2, subspace_dim=4)
    g = torch.Generator().manual_seed(0)
    sub, full = GaussianPrior(cfg, g), GaussianPrior(JEPAConfig(prior="full", latent=16), g)
    basis = sub.basis.reshape(16, 8)  # the frozen subspaces, orthonormal
    assert torch.allclose(basis.T @ basis, torch.eye(8), atol=1e-5)
    complement = torch.linalg.svd(torch.eye(16) - basis @ basis.T).U[:, :8]
    # standard normal inside the subspaces, collapsed to one point outside them
    z = torch.randn(4096, 8, generator=g) @ basis.T + 5.0 * complement.sum(1)
    assert float(sub(z)) < 3e-3 < 0.05 < float(full(z))
    gaussian = torch.randn(4096, 16, generator=g)  # standard normal everywhere: both priors content
    assert float(sub(gaussian)) < 3e-3 and float(full(gaussian)) < 3e-3


def test_a_bad_prior_setting_is_one_line():
    with pytest.raises(ValueError, match="prior must be one of subspace, full"):
        JEPAConfig(prior="both")
    with pytest.raises(ValueError, match="do not fit a latent of 8"):
        JEPAConfig(latent=8, subspaces=4, subspace_dim=4)
    with pytest.raises(ValueError, match="replan_every must be 1 to the horizon, 6"):
        JEPAConfig(replan_every=7)
    with pytest.raises(ValueError, match="activation must be one of elu, relu, silu"):
        JEPAConfig(activation="gelu")


def test_replayed_runs_are_consecutive_steps_of_one_game_across_the_rings_wrap():
    replay = Replay(capacity=16, num_envs=3, n_obs=2)
    for t in range(30):  # wraps: steps 14..29 are kept
        obs = np.array([[t, e] for e in range(3)], np.float32)
        replay.add(obs, np.full(3, t % 3), np.zeros(3, np.float32), np.zeros(3, np.float32), obs + [1, 0])
    runs = replay.sample(500, 5, np.random.default_rng(0))
    steps, envs = runs["obs"][..., 0], runs["obs"][..., 1]
    assert (steps.diff(dim=1) == 1).all() and (envs == envs[:, :1]).all()
    assert steps.min() == 14 and steps.max() == 29  # only what the ring holds, up to its newest step
    assert (runs["next_obs"][:, :-1] == runs["obs"][:, 1:]).all()
    assert (runs["actions"] == steps.long() % 3).all()


def test_the_planners_hand_applied_dynamics_score_sequences_as_the_world_model_steps_them():
    agent = JEPAAgent(6, 3, 4, seed=0, total_steps=100)
    z = agent.model.encoder(torch.randn(4, 6)).detach()
    sequences = torch.randint(0, 3, (4, 5, agent.cfg.horizon))
    expected = torch.zeros(4, 5)
    with torch.no_grad():
        for e in range(4):
            for p in range(5):
                latent, weight = z[e:e + 1], 1.0
                for action in sequences[e, p]:
                    latent, logits = agent.model.step(latent, action[None])
                    end, win = torch.sigmoid(logits[0])
                    expected[e, p] += weight * end * (2 * win - 1)
                    weight = weight * (1 - end) * agent.cfg.gamma
                expected[e, p] += weight * agent.model.value(latent)[0, 0]
    assert torch.allclose(agent.score(z, sequences), expected, atol=1e-5)


def test_the_world_model_learns_which_action_wins_and_the_planner_picks_it():
    """One step per point: action 2 wins it, the others lose it (the reward head must tell them apart). Every
    point ends after one action, so the agent plans every step (a plan's later actions are for points to come)."""
    n = 16
    agent = JEPAAgent(6, 3, n, seed=0, total_steps=600, cfg=JEPAConfig(warmup=50, explore_fraction=0.3, replan_every=1))
    obs = np.random.default_rng(0).normal(size=(n, 6)).astype(np.float32)
    for _ in range(600):
        actions = agent.act(obs)
        agent.observe(obs, actions, np.where(actions == 2, 1.0, -1.0).astype(np.float32), np.ones(n, bool), obs)
    assert (agent.act(obs, greedy=True) == 2).all()


@pytest.mark.slow
def test_the_runner_puts_the_world_models_beside_ppo_and_gives_the_same_numbers_on_one_process_or_two(tmp_path, capsys):
    """``localrl baselines pong --agent jepa`` at a tiny size (its smoke test): every learner's row, the
    comparisons, the latent's rank; and the runs spread over two processes equal the runs in this one."""
    from localrl.cli import main

    args = ["baselines", "pong", "--agent", "jepa", "--steps", "12800", "--seeds", "1", "--eval-points", "40"]
    assert main([*args, "--out", str(tmp_path / "two"), "--workers", "2"]) == 0
    table = capsys.readouterr().out
    for row in ("| PPO |", "| PC+Hebbian |", "| JEPA world model, subspace prior (Sub-JEPA) |",
                "| JEPA world model, full-latent prior (LeWM) |", "JEPA world model, subspace prior (Sub-JEPA) minus "
                "JEPA world model, full-latent prior (LeWM):", "Effective rank of the latent"):
        assert row in table
    assert main([*args, "--out", str(tmp_path / "one"), "--workers", "1"]) == 0
    one, two = (json.loads((tmp_path / d / "results.json").read_text())["agents"] for d in ("one", "two"))
    assert {name: r["per_seed"] for name, r in one.items()} == {name: r["per_seed"] for name, r in two.items()}
    assert {name: r["curves"] for name, r in one.items()} == {name: r["curves"] for name, r in two.items()}
    assert (tmp_path / "one" / "learning_curves.png").stat().st_size > 0
