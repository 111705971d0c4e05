"""--report-to: every field of every train and eval record reaches TensorBoard's event files, trackio's store,
Weights & Biases' offline run and MLflow's store under the names metrics.jsonl has, with the learning curve at the
end; read back with each tool's own reader (W&B has no Python reader of its offline log: its frames are read here,
each record parsed with W&B's own protobuf message)."""

from __future__ import annotations

import shutil

import pytest

import json
import struct
import subprocess
import sys
from pathlib import Path

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
        requires, extra = "json,localrl_tests_no_such_package", "elsewhere"  # (each module of the list is looked for)

    trackers.register("elsewhere", Elsewhere)
    try:
        with pytest.raises(UserError, match=r"^config field report_to: elsewhere needs the "
                                            r"localrl_tests_no_such_package package, which is not installed: "
                                            r"pip install 'localrl\[elsewhere\]'$"):
            check_report_to("tensorboard,elsewhere")
    finally:
        trackers.unregister("elsewhere")
    with pytest.raises(UserError, match="report_to: 'comet' is not a known tracker"):
        check_report_to("comet")
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


def wandb_history(run_dir) -> tuple[set[str], dict[str, dict[int, float]], set[str]]:
    """The W&B run ids of the run's offline folders, and what they logged: tag -> {step: value} (a step logged
    again, after a resume, by its last value), and the image tags."""
    from wandb.proto import wandb_internal_pb2

    ids, scalars, images = set(), {}, set()
    for log in sorted(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb")):  # (in the order they were written)
        for record in _leveldb_records(log.read_bytes()):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            if parsed.WhichOneof("record_type") == "run":
                ids.add(parsed.run.run_id)
            if parsed.WhichOneof("record_type") != "history":
                continue
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in parsed.history.item}
            pictures = {t.rpartition("/")[0] for t, v in row.items() if t.endswith("/_type") and v == "image-file"}
            images |= pictures
            for tag, value in row.items():
                if not tag.startswith("_") and tag.partition("/")[0] not in pictures:
                    scalars.setdefault(tag, {})[row["_step"]] = value
    return ids, scalars, images


def _leveldb_records(data: bytes):
    """The records of a W&B transaction log: a 7-byte header (":W&B", 0xBEE1, version), then LevelDB's log format
    (32 KiB blocks of chunks, each ``crc32c, length, type``: full, first, middle, last)."""
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    pos, parts, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeroes up to the block's end
            pos += block - pos % block
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield parts
            parts = b""


def mlflow_history(run_dir) -> tuple[int, dict[str, dict[int, float]], list[str], dict]:
    """How many MLflow runs the run's store holds, and its run's metrics (tag -> {step: value}, a step logged again by
    its last value), artifacts and parameters, as MLflow's client reads them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("localrl").experiment_id])
    run = runs[0]
    scalars = {}
    for tag in run.data.metrics:
        history = sorted(client.get_metric_history(run.info.run_id, tag), key=lambda m: m.timestamp)
        scalars[tag] = {m.step: m.value for m in history}
    return len(runs), scalars, [a.path for a in client.list_artifacts(run.info.run_id)], run.data.params


def _offline(*flags) -> None:
    """``localrl train FLAGS`` with no network at all: in a network namespace of its own, no interface up."""
    proc = subprocess.run(["unshare", "--net", sys.executable, "-m", "localrl", "train", *map(str, flags)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "INFO" not in proc.stderr + proc.stdout  # (MLflow's store set-up lines are kept out of the display)


@pytest.mark.slow
def test_wandb_and_mlflow_get_every_record_offline_and_a_resumed_run_continues_the_same_runs(builtin_model,
                                                                                             tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare --net (a network namespace) to prove the run uses no network")
    run_dir = tmp_path / "run"
    _offline("--report-to", "wandb,mlflow", "--steps", 3, "--prompts-per-step", 4, "--group-size", 4,
             "--max-new-tokens", 48, "--seed", 7, "--save-every", 2, "--eval-size", 8, "--run-dir", run_dir)
    # as after a crash between step 3's record and its checkpoint: step 3 is computed again on resume
    shutil.rmtree(Run(run_dir).checkpoints_dir / "step-000003")
    _offline("--resume", run_dir, "--steps", 4)
    want = expected(run_dir)
    assert sorted(want["train/reward_mean"]) == [1, 2, 3, 4] and sorted(want["eval/accuracy"]) == [0, 4]

    def same(logged: dict[str, dict[int, float]]) -> None:
        """Every record of metrics.jsonl, by its last value; besides them only the 3-step run's last evaluation (at
        step 3, past the checkpoint the resume started from: W&B and MLflow cannot take a logged point back)."""
        assert set(logged) == set(want)
        for tag, by_step in want.items():
            assert {s: v for s, v in logged[tag].items() if s in by_step} == pytest.approx(by_step), tag
            assert set(logged[tag]) - set(by_step) <= ({3} if tag.startswith("eval/") else set()), tag

    ids, scalars, images = wandb_history(run_dir)
    assert len(ids) == 1 and len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # one W&B run, resumed
    same(scalars)
    assert images == {"learning_curve"}
    runs, scalars, artifacts, params = mlflow_history(run_dir)
    assert runs == 1  # one MLflow run, resumed
    same(scalars)
    assert "learning_curve.png" in artifacts and params["steps"] == "3" and params["report_to"] == "'wandb,mlflow'"
