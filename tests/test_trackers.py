"""--report-to: every field of every train and eval record reaches TensorBoard's event files and trackio's
store under the names metrics.jsonl has, with the learning curve at the end; read back with each tool's own
reader."""

from __future__ import annotations

import shutil

import pytest

from localrl.errors import UserError
from localrl.metrics import read_metrics
from localrl.runs import Run
from localrl.trackers import Tracker, check_report_to, flatten, trackers
from localrl.training.loop import resume_config, train
from tests.helpers import QUIET, one_line, small

pytest.importorskip("tensorboard")
pytest.importorskip("trackio")


def tensorboard_scalars(run_dir) -> tuple[dict[str, dict[int, float]], list[str]]:
    """tag -> {step: value}, and the image tags, as TensorBoard reads the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Run(run_dir).tensorboard_dir), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in tags["scalars"]}
    steps = {tag: [e.step for e in events.Scalars(tag)] for tag in tags["scalars"]}
    assert all(len(s) == len(set(s)) for s in steps.values()), "a step logged twice"
    return scalars, tags["images"]


def expected(run_dir) -> dict[str, dict[int, float]]:
    """What the trackers should hold: tag -> {step: value}, from metrics.jsonl."""
    out: dict[str, dict[int, float]] = {}
    for record in read_metrics(Run(run_dir).metrics_path):
        if record["kind"] in ("train", "eval"):
            for tag, value in flatten(record, record["kind"]).items():
                out.setdefault(tag, {})[record["step"]] = value
    return out


def test_flatten_keeps_numbers_under_the_metrics_file_names():
    record = {"kind": "train", "step": 3, "reward_mean": 0.5, "rewards": {"numeric_match": 1, "format": 0.25},
              "reward_length_corr": None, "objective": "grpo", "sizes": [1, 2], "clipped": True}
    assert flatten(record, "train") == {"train/reward_mean": 0.5, "train/rewards/numeric_match": 1.0,
                                        "train/rewards/format": 0.25, "train/clipped": 1.0}


@pytest.mark.slow
def test_tensorboard_and_trackio_get_every_record(builtin_model, tmp_path, monkeypatch):
    from trackio.sqlite_storage import SQLiteStorage

    monkeypatch.setenv("TRACKIO_PROJECT", "localrl-test-records")
    result = train(small(tmp_path / "run", steps=3, eval_size=8, report_to="tensorboard,trackio"), **QUIET)
    want = expected(result.run_dir)
    assert {"train/reward_mean", "train/loss", "train/rewards/numeric_match", "eval/accuracy"} <= set(want)
    assert sorted(want["train/reward_mean"]) == [1, 2, 3] and sorted(want["eval/accuracy"]) == [0, 3]
    assert len(set(want["train/reward_mean"].values())) > 1  # (records that differ step to step)

    scalars, images = tensorboard_scalars(result.run_dir)
    assert set(scalars) == set(want)
    for tag, by_step in want.items():
        assert scalars[tag] == pytest.approx(by_step, rel=1e-6), tag  # (TensorBoard keeps float32)
    assert images == ["learning_curve"]
    assert Run(result.run_dir).learning_curve_path.stat().st_size > 1000

    logs = SQLiteStorage.get_logs("localrl-test-records", result.run_dir.name)
    stored: dict[str, dict[int, float]] = {}
    for row in logs:
        for tag, value in row.items():
            if tag not in ("step", "timestamp"):
                stored.setdefault(tag, {})[row["step"]] = value
    picture = stored.pop("learning_curve")
    assert stored == want
    assert list(picture) == [3] and picture[3]["_type"] == "trackio.image"
    config = SQLiteStorage.get_run_config("localrl-test-records", result.run_dir.name)
    assert config["report_to"] == "tensorboard,trackio" and config["steps"] == 3


@pytest.mark.slow
def test_a_resumed_run_logs_each_step_once(builtin_model, tmp_path):
    part = train(small(tmp_path / "run", steps=3, save_every=2, report_to="tensorboard"), **QUIET)
    # as after a crash between step 3's record and its checkpoint: step 3 is recomputed on resume
    shutil.rmtree(Run(part.run_dir).checkpoints_dir / "step-000003")
    train(resume_config(part.run_dir, {"steps": 4}), resume=True, **QUIET)
    scalars, _ = tensorboard_scalars(part.run_dir)
    assert sorted(scalars["train/reward_mean"]) == [1, 2, 3, 4]
    assert scalars["train/reward_mean"] == pytest.approx(expected(part.run_dir)["train/reward_mean"], rel=1e-6)


def test_a_tracker_whose_package_is_missing_is_one_line_naming_the_extra():
    class Elsewhere(Tracker):
        requires, extra = "localrl_tests_no_such_package", "elsewhere"

    trackers.register("elsewhere", Elsewhere)
    try:
        with pytest.raises(UserError, match=r"^config field report_to: elsewhere needs the "
                                            r"localrl_tests_no_such_package package, which is not installed: "
                                            r"pip install 'localrl\[elsewhere\]'$"):
            check_report_to("tensorboard,elsewhere")
    finally:
        trackers.unregister("elsewhere")
    with pytest.raises(UserError, match="report_to: 'wandb' is not a known tracker"):
        check_report_to("wandb")
    with pytest.raises(UserError, match="'none' cannot be combined"):
        check_report_to("none,tensorboard")
    check_report_to("none")


def test_a_tracker_named_twice_is_one_line_before_anything_is_written(tmp_path, capsys):
    """(It wrote two TensorBoard event files of the same records.)"""
    line = one_line(capsys, "train", "--report-to", "tensorboard, trackio,tensorboard", "--run-dir", tmp_path / "run")
    assert line == "localrl: error: config field report_to: tensorboard named twice (each tracker gets the records once)"
    assert not (tmp_path / "run").exists()


def test_report_to_is_checked_before_the_run_directory_is_made(builtin_model, tmp_path):
    with pytest.raises(UserError, match="not a known tracker"):
        train(small(tmp_path / "run", steps=1, report_to="tensorbord"), **QUIET)
    assert not (tmp_path / "run").exists()
