"""Turn-level credit (``--objective turn_grpo``): constructed episodes whose second turn alone is right, the returns
by hand, per-token advantages through GRPO's loss, the shell's process rewards, a run and its resume, bad settings."""

from __future__ import annotations

import pytest
import torch

from localrl.config import TrainConfig
from localrl.errors import UserError
from localrl.policy.credit import turn_advantages, turn_returns
from localrl.policy.losses import LossSettings, grpo_loss
from localrl.training.loop import train
from localrl.training.settings import build_config
from tests.helpers import QUIET, train_records

# two episodes of one task, two turns each, an observation (tokens 3-4) between the turns
SPANS = [[(0, 3), (5, 8)], [(0, 3), (5, 8)]]


def test_only_the_turn_that_was_right_is_credited():
    """Episode 0's second turn alone meets the verifier (turn rewards 0 then 1); episode 1 never does. With each
    turn credited with its own (turn_discount 0), only episode 0's second-turn tokens get a positive advantage,
    episode 1's second turn the negative one, and the first turns and the observation's tokens none."""
    adv = turn_advantages(SPANS, [[0.0, 1.0], [0.0, 0.0]], [1.0, 0.0], group_size=2, width=9, gamma=0.0)
    positive = torch.zeros(2, 9, dtype=torch.bool)
    positive[0, 5:8] = True
    assert (adv[positive] > 0).all() and (adv[~positive] <= 0).all()
    assert torch.allclose(adv[1, 5:8], -adv[0, 5:8]) and (adv[:, :5] == 0).all() and (adv[:, 8:] == 0).all()
    assert adv[0, 5].item() == pytest.approx(2 ** -0.5)  # (1 - 0.5) / std([1, 0]) over two episodes
    # with the whole return (turn_discount 1) the first turn is credited as episode-level GRPO credits the episode
    whole = turn_advantages(SPANS, [[0.0, 1.0], [0.0, 0.0]], [1.0, 0.0], group_size=2, width=9, gamma=1.0)
    assert whole[0, :3].tolist() == pytest.approx([2 ** -0.5] * 3) and whole[1, :3].tolist() == pytest.approx(
        [-(2 ** -0.5)] * 3)


def test_returns_by_hand():
    # the remainder of the final reward goes to the last turn, so an episode's turn rewards add up to it
    # rewards [0.5, 0, 0.25] + the remainder 0.25 on the last: [0.5, 0, 0.5]; G2 = 0.5, G1 = 0 + 0.5 * 0.5,
    # G0 = 0.5 + 0.5 * 0.25
    assert turn_returns([0.5, 0.0, 0.25], 3, 1.0, gamma=0.5) == pytest.approx([0.625, 0.25, 0.5])
    assert turn_returns([], 2, 1.0, gamma=0.9) == pytest.approx([0.9, 1.0])  # no process rewards: the final only
    # a group where only one episode reached a turn index: no comparison there, no advantage
    adv = turn_advantages([[(0, 2)], [(0, 2), (3, 5)]], [[0.0], [0.0, 1.0]], [0.0, 1.0], 2, 6, 0.0)
    assert (adv[1, 3:5] == 0).all()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo"])
def test_per_token_advantages_equal_per_completion_ones_when_constant_along_the_row(loss_type):
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.1 - 1
    old = logp + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.2
    mask = (torch.rand(4, 6, generator=g) < 0.8).long()
    adv = torch.tensor([1.0, -0.5, 0.25, 0.0], dtype=torch.float64)
    settings = LossSettings.of(TrainConfig(loss_type=loss_type, epsilon_high=0.28))
    rows, _ = grpo_loss(logp, old, adv, mask, settings)
    tokens, _ = grpo_loss(logp, old, adv[:, None].expand(4, 6), mask, settings)
    assert torch.allclose(rows, tokens, rtol=1e-12)


def test_the_shell_gives_each_turn_its_share_of_the_verifiers_checks(tmp_path):
    """Copy a file, then answer: three checks (the original kept, met from the start; the copy; the answer): each
    turn's reward is what it added, a third for the copy and a third for the answer."""
    from localrl.envs.shell import ShellEnv
    from localrl.envs.shell_tasks import generate
    from tests.helpers import tool_call

    task = generate(0, "multi", 1)
    assert task.check.answer is not None and task.check.files, task.check  # (the family's level-1 shape)
    env = ShellEnv(lambda seed: task, max_turns=6, root=tmp_path)
    env.reset(0)
    rewards = []
    for command in ("ls", *task.solution):  # look, mkdir, cp, wc -l
        env.step(tool_call(command))
        rewards.append(env.turn_reward())
    env.step(f"<answer>{task.check.answer}</answer>")
    rewards.append(env.turn_reward())
    assert rewards == pytest.approx([0.0, 0.0, 1 / 3, 0.0, 1 / 3]) and env.reward() == 1.0
    env.close()


def files_made(state: dict) -> float:
    """A user's process reward: a tenth for each file in the working directory (at most 1)."""
    return min(sum(1 for p in state["workdir"].rglob("*") if p.is_file()) / 10, 1.0)


def quarter(state: dict) -> float:
    return 0.25


def broken(state: dict) -> float:
    raise KeyError("score")


def test_a_users_process_reward_reads_the_shells_state_after_each_turn(tmp_path):
    from localrl.envs.shell import ShellEnv
    from localrl.envs.shell_tasks import generate
    from tests.helpers import tool_call

    task = generate(0, "multi", 1)
    env = ShellEnv(lambda seed: task, max_turns=6, root=tmp_path)
    env.reset(0)
    before = files_made(env.state())
    env.step(tool_call("touch a.txt b.txt"))
    state = env.state()
    assert state["turns"] == 1 and state["answer"] is None and state["instruction"] == task.instruction
    assert files_made(state) == pytest.approx(before + 0.2)
    env.step("<answer>done</answer>")
    assert env.state()["answer"] == "<answer>done</answer>"
    env.close()


def _config(run_dir, **kw) -> TrainConfig:
    return build_config(None, {"env": "shell", "objective": "turn_grpo", "prompts_per_step": 2, "group_size": 4,
                               "eval_size": 0, "save_every": 1, "seed": 3, "run_dir": str(run_dir), **kw})


def test_a_turn_grpo_run_records_its_turn_rewards(tmp_path):
    """(Its resume: tests/test_resume_contract.py.)"""
    records = train_records(train(_config(tmp_path / "run", steps=2), **QUIET).run_dir)
    assert [r["step"] for r in records] == [1, 2] and all(r["turn_reward_mean"] is not None for r in records)


def test_a_turn_grpo_run_credits_a_users_process_reward(tmp_path):
    """``--process-reward`` gives every turn's reward (the shell's own are not used): a function that says 0.25
    after every turn makes every turn reward 0.25; the shell's own rewards of the same run are not all alike."""
    result = train(_config(tmp_path / "run", steps=1, process_reward="tests.test_credit:quarter"), **QUIET)
    [record] = train_records(result.run_dir)
    assert record["turn_reward_mean"] == pytest.approx(0.25)
    [own] = train_records(train(_config(tmp_path / "own", steps=1), **QUIET).run_dir)
    assert own["turn_reward_mean"] != pytest.approx(0.25)


def test_a_process_reward_that_fails_stops_before_anything_is_written(tmp_path):
    with pytest.raises(UserError, match="process reward tests.test_credit:broken failed: KeyError: 'score'"):
        train(_config(tmp_path / "run", process_reward="tests.test_credit:broken"), **QUIET)
    with pytest.raises(UserError, match="process reward 'tests.test_credit:nope': cannot import it"):
        train(_config(tmp_path / "run", process_reward="tests.test_credit:nope"), **QUIET)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, message", [
    ({"process_reward": "m:f"}, "config field process_reward: scores an environment's turns: it needs env"),
    ({"env": "shell", "process_reward": "nocolon"}, "config field process_reward: must be package.module:function"),
    ({"objective": "turn_grpo"}, "config field objective: turn_grpo credits the turns of an episode: it needs env"),
    ({"env": "shell", "objective": "turn_grpo", "turn_discount": 1.5}, "config field turn_discount: must be in"),
    ({"env": "shell", "turn_discount": 0.5}, "config field turn_discount: needs objective turn_grpo"),
    ({"env": "shell", "objective": "turn_grpo", "loss_type": "vespo"}, "config field loss_type: vespo weighs"),
])
def test_bad_turn_grpo_settings_are_one_line(flags, message):
    with pytest.raises(UserError, match=message):
        build_config(None, flags)
