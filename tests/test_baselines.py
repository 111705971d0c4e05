"""Backprop-free baselines: the parts are checked against what they claim to compute."""

import numpy as np
import pytest
import torch

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
