"""A user's data from every format TRL's users keep it in: JSONL, Parquet, CSV, JSON, Arrow, a save_to_disk
directory and a hub id in the local datasets cache (built here, offline), read through columns and an answer
format; the same rows from each, two training steps from each, and bad sources in one line."""

from __future__ import annotations

import csv
import glob
import json
import re
import shutil
from pathlib import Path

import pytest

from localrl.data import load_task
from localrl.data.sources import Columns, extract_answer, read_rows
from localrl.errors import UserError
from localrl.training.settings import build_config

DATA = Path(__file__).parent / "data" / "gsm8k_shaped.jsonl"
GSM8K = Columns(prompt="question", answer="answer", answer_format="gsm8k")


def _rows() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines()][:60]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """The same 60 GSM8K-shaped rows in every format (the test split: the last 10)."""
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, d = _rows(), tmp_path_factory.mktemp("sources")
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), d / "rows.parquet")
    with (d / "rows.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, ["question", "answer"])
        writer.writeheader()
        writer.writerows(rows)
    (d / "rows.json").write_text(json.dumps(rows))
    (d / "columns.json").write_text(json.dumps({k: [r[k] for r in rows] for k in ("question", "answer")}))
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:50]),
                                   "test": datasets.Dataset.from_list(rows[50:])})
    splits.save_to_disk(str(d / "saved"))
    shutil.copy(glob.glob(str(d / "saved" / "train" / "*.arrow"))[0], d / "rows.arrow")  # 50 rows
    return {"jsonl": str(d / "rows.jsonl"), "parquet": str(d / "rows.parquet"), "csv": str(d / "rows.csv"),
            "json": str(d / "rows.json"), "json-columns": str(d / "columns.json"), "arrow": str(d / "rows.arrow"),
            "save_to_disk": str(d / "saved")}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """``localrl/gsm8k-shaped`` (config main, splits train and test) in a fresh datasets cache, laid out as
    ``datasets.load_dataset`` leaves a hub dataset it downloaded (its cache layout, its dataset_info.json)."""
    datasets = pytest.importorskip("datasets")
    import datasets.config

    rows, cache = _rows(), tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    src = tmp_path / "src"
    src.mkdir()
    for name, part in (("train", rows[:50]), ("test", rows[50:])):
        (src / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    datasets.load_dataset("json", data_files={s: str(src / f"{s}.jsonl") for s in ("train", "test")},
                          cache_dir=str(cache))
    built = Path(glob.glob(str(cache / "json" / "*"))[0])
    target = cache / "localrl___gsm8k-shaped" / "main"
    target.parent.mkdir(parents=True)
    shutil.move(str(built), str(target))
    for info in target.glob("*/*/dataset_info.json"):
        info.write_text(json.dumps({**json.loads(info.read_text()), "config_name": "main"}))
    for arrow in target.glob("*/*/json-*.arrow"):  # the hub's files are named after the dataset
        arrow.rename(arrow.with_name(arrow.name.replace("json-", "gsm8k-shaped-", 1)))
    return "localrl/gsm8k-shaped"


def test_answer_formats():
    assert extract_answer("so 3 + 4 = 7.\n#### 1,007", "gsm8k") == "1007"
    assert extract_answer("no marker here", "gsm8k") is None
    assert extract_answer("between 3 and 12.5 apples", "last-number") == "12.5"
    assert extract_answer("The answer: (B) twelve", r"regex:\(([A-D])\)") == "B"
    assert extract_answer("plain", "") == "plain"


def test_every_format_gives_the_same_rows(sources):
    expected = [{"prompt": r["question"], "answer": r["answer"].rpartition("####")[2].strip()} for r in _rows()]
    for name, source in sources.items():
        rows = read_rows(source, GSM8K)
        n = 50 if name in ("arrow", "save_to_disk") else 60  # the Arrow file and the dict's default split: train
        assert [{k: r[k] for k in ("prompt", "answer")} for r in rows] == expected[:n], name
    held = load_task(sources["save_to_disk"], eval_size=100, columns=Columns(**{**GSM8K.__dict__, "eval_split": "test"}))
    assert [r["prompt"] for r in held.held_out] == [r["prompt"] for r in expected[50:]] and len(held.rows) == 50


def test_held_out_rows_are_never_training_rows_and_a_split_a_file_lacks_is_one_line(sources):
    """Of every source kind, the held-out rows and the training rows are apart (a file: a seeded tenth set aside; a
    save_to_disk directory: its test split). A file's "test split", config or other split was ignored, and held out
    rows it trained on: each is one line naming the field."""
    for name, source in sources.items():
        eval_split = "test" if name == "save_to_disk" else ""
        task = load_task(source, eval_size=100, columns=Columns(**{**GSM8K.__dict__, "eval_split": eval_split}))
        held, trained = {r["prompt"] for r in task.held_out}, {r["prompt"] for r in task.rows}
        assert held and trained and not held & trained, name
    cases = [({"eval_split": "test"}, "config field eval_split: data {jsonl} is a file, which has no splits: give its "
                                      "held-out rows as --eval-data FILE"),
             ({"split": "test"}, "config field data_split: data {jsonl} is a file, which has no splits"),
             ({"config": "main"}, "config field data_config: data {jsonl} is a file, which has no configs")]
    for fields, message in cases:
        with pytest.raises(UserError) as e:
            load_task(sources["jsonl"], columns=Columns(**{**GSM8K.__dict__, **fields}))
        assert str(e.value).startswith(message.format(**sources)), str(e.value)
    with pytest.raises(UserError, match="config field eval_split: eval_data .*rows.csv is a file, which has no"):
        load_task(sources["save_to_disk"], sources["csv"], columns=Columns(**{**GSM8K.__dict__, "eval_split": "test"}))
    with pytest.raises(UserError, match="config field eval_split: data arith is a built-in task, which has no"):
        load_task("arith", columns=Columns(eval_split="test"))


@pytest.mark.parametrize("prompt, message", [
    ([{"role": "wizard", "content": "2 + 2?"}],
     "'prompt' message 0: role 'wizard' is none of system, developer, user, assistant, tool, function, ipython"),
    ([{"role": "system", "content": "Answer."}], "'prompt' has no user message (nothing is asked)"),
])
def test_a_conversation_a_chat_template_cannot_ask_is_one_line(tmp_path, prompt, message):
    """(Both trained: the template rendered the wizard's turn as it could, and a lone system message asked nothing.)"""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}) + "\n"
                    + json.dumps({"prompt": prompt, "answer": "4"}) + "\n")
    with pytest.raises(UserError, match="^" + re.escape(f"{data}:2: {message}")):
        load_task(str(data))


def test_a_damaged_save_to_disk_directory_is_one_line(sources, tmp_path):
    """(A JSONDecodeError and an ArrowInvalid or OSError traceback.)"""
    state, cut = tmp_path / "state", tmp_path / "cut"
    for d in (state, cut):
        shutil.copytree(sources["save_to_disk"], d)
    (state / "train" / "state.json").write_text("{broken")
    arrow = Path(glob.glob(str(cut / "train" / "*.arrow"))[0])
    arrow.write_bytes(arrow.read_bytes()[:arrow.stat().st_size // 2])
    for d, why in ((state, "JSONDecodeError: Expecting property name"), (cut, "(ArrowInvalid|OSError): ")):
        with pytest.raises(UserError, match="^" + re.escape(f"data {d}: a save_to_disk directory that cannot be "
                                                            f"read (") + why):  # (where it is cut: either)
            read_rows(str(d), GSM8K)


@pytest.mark.parametrize("name", ["p.csv", "p.json"])
def test_a_file_that_cannot_be_read_is_one_line(tmp_path, name):
    """(A PermissionError traceback for CSV and JSON; JSONL and Parquet said it in one line.) Root reads any file,
    so a file whose every read fails stands for an unreadable one: /proc/self/mem under the name."""
    (tmp_path / name).symlink_to("/proc/self/mem")
    with pytest.raises(UserError, match="^" + re.escape(f"data {tmp_path / name}: cannot be read (")):
        read_rows(str(tmp_path / name))


def test_a_cached_hub_id_reads_offline(hub_cache, monkeypatch):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # a process online, as a user's may be
    task = load_task(hub_cache, eval_size=100, columns=Columns("question", "answer", "gsm8k", "main", "train", "test"))
    assert len(task.rows) == 50 and len(task.held_out) == 10 and task.rows[0]["answer"] == \
        _rows()[0]["answer"].rpartition("####")[2].strip()
    assert datasets.config.HF_HUB_OFFLINE is False  # read offline, the process's own setting left as it was


def test_a_missing_held_out_split_names_eval_split(sources):
    """(It said set --data-split, the flag of the training split, which was there.)"""
    with pytest.raises(UserError, match=r"^eval_data .*saved: no split 'validation' \(splits: train, test\); set "
                                        r"--eval-split$") as e:
        load_task(sources["save_to_disk"], columns=Columns(**{**GSM8K.__dict__, "eval_split": "validation"}))
    assert e.value.field == "eval_split"


@pytest.mark.parametrize("overrides, message", [
    ({"prompt_column": "prompt"}, ":row 1: missing 'prompt' (--prompt-column names another); columns: question, answer"),
    ({"data_split": "validation"}, "no split 'validation' (splits: train, test); set --data-split"),
    ({"answer_format": "last-number", "answer_column": "question"}, None),  # every question holds a number: fine
    ({"answer_format": r"regex:Z(\d+)"}, ":row 1: answer format regex:Z(\\d+) finds no answer"),
    ({"answer_format": r"regex:(\d*)"}, ":row 1: answer format regex:(\\d*) finds no answer"),  # (it found '' in each)
])
def test_bad_columns_and_splits_are_one_line(sources, overrides, message):
    def read():  # (the config's check reads the first row, for its columns: a missing split is said there)
        cfg = build_config(None, {"data": sources["save_to_disk"], "prompt_column": "question",
                                  "answer_format": "gsm8k", **overrides})
        return read_rows(cfg.data, Columns.of(cfg))

    if message is None:
        assert read()
        return
    with pytest.raises(UserError) as e:
        read()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_uncached_hub_id_and_a_missing_config_are_one_line(hub_cache):
    with pytest.raises(UserError, match="'localrl/not-there': not a file, a built-in task .* local Hugging Face "
                                        "cache") as e:
        read_rows("localrl/not-there")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"no config 'other' in the local cache \(cached: \['main'\]\)"):
        read_rows(hub_cache, Columns("question", config="other"))


@pytest.mark.slow
def test_a_training_step_from_every_format(sources, hub_cache, builtin_model, tmp_path, capsys):
    """Through the CLI, as a user runs it: each source trains a step and evaluates its held-out rows."""
    from localrl.cli import main
    from localrl.metrics import read_metrics

    runs = {**sources, "hub": hub_cache}
    for name, source in runs.items():
        run = tmp_path / name
        extra = ["--data-config", "main"] if name == "hub" else []
        assert main(["train", "--data", source, *extra, "--prompt-column", "question", "--answer-format", "gsm8k",
                     "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "16",
                     "--eval-size", "2", "--run-dir", str(run), "--rollout", "torch"]) == 0, name
        records = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in records if r["kind"] == "train"] == [1], name
        assert [r["n"] for r in records if r["kind"] == "eval"] == [2, 2], name


def test_conversational_prompts_from_parquet(tmp_path):
    """A `prompt` column of chat messages (TRL's conversational format) survives Parquet and reaches the rows."""
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "system", "content": "Answer with a number."},
                        {"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    assert read_rows(str(tmp_path / "chat.parquet")) == rows
    pq.write_table(pa.Table.from_pylist([{"prompt": [], "answer": "1"}]), tmp_path / "empty.parquet")
    with pytest.raises(UserError, match=r"empty.parquet:row 1: 'prompt' must be a string or a list of \{role"):
        read_rows(str(tmp_path / "empty.parquet"))


def _key(row: dict) -> str:
    return json.dumps(row["prompt"], sort_keys=True)


def test_held_out_rows_are_never_training_rows_from_any_source(sources, hub_cache):
    """Every kind of source, with and without a held-out split or file: no held-out prompt is a training prompt
    (with --eval-split on a file it was: its 'test split' was its own rows, 5 of 5)."""
    cases = [(name, source, GSM8K, "") for name, source in sources.items()]
    cases += [("save_to_disk, test split", sources["save_to_disk"], Columns(**{**GSM8K.__dict__, "eval_split": "test"}),
               ""),
              ("hub id", hub_cache, Columns(**{**GSM8K.__dict__, "config": "main"}), ""),
              ("hub id, test split", hub_cache, Columns(**{**GSM8K.__dict__, "config": "main", "eval_split": "test"}),
               ""),
              ("eval_data file", sources["arrow"], GSM8K, sources["jsonl"])]  # (the arrow file: the first 50 rows)
    for name, source, columns, eval_data in cases:
        task = load_task(source, eval_data, eval_size=100, columns=columns)
        held, train = {_key(r) for r in task.held_out}, {_key(r) for r in task.rows}
        assert held and train, name
        if not eval_data:
            assert not held & train, name
        else:  # a separate file of the user's: its rows as they are (which the run's start line states)
            assert len(held) == 60, name
    for task_name in ("arith", "words", "drafts"):  # generated: the held-out problems are never drawn for training
        from localrl.data import GENERATORS
        import random

        task = load_task(task_name, eval_size=50)
        drawn = {_key({"prompt": p.question}) for p in GENERATORS[task_name].sample_problems(random.Random(1), 2000)}
        assert not {_key(r) for r in task.held_out} & drawn, task_name


def test_held_out_pairs_and_demonstrations_are_never_trained_on(tmp_path):
    from localrl.config import TrainConfig
    from localrl.samplers.demonstrations import Demonstrations
    from localrl.samplers.preferences import Preferences
    from tests.helpers import write_demonstrations, write_pairs

    for sampler, data in ((Preferences, write_pairs(tmp_path / "pairs.jsonl", 60)),
                          (Demonstrations, write_demonstrations(tmp_path / "demos.jsonl", 60))):
        s = sampler(TrainConfig(data=data, eval_size=20))
        s.prepare(None)
        held, train = {_key(r) for r in s.task.held_out}, {_key(r) for r in s.task.rows}
        assert len(held) == 6 and train and not held & train, sampler.__name__


def test_a_held_out_file_that_repeats_training_rows_is_said_in_the_runs_first_lines(sources, builtin_model):
    import torch

    from localrl.modeling import load_config, load_tokenizer
    from localrl.samplers import ModelInfo
    from localrl.samplers.completions import Completions

    path, config = load_config(str(builtin_model))
    info = ModelInfo(path, config, load_tokenizer(path), None, torch.device("cpu"))
    fields = {"data": sources["jsonl"], "prompt_column": "question", "answer_format": "gsm8k", "eval_size": 5,
              "rollout": "torch"}
    plan = Completions(build_config(None, {**fields, "eval_data": sources["jsonl"]})).prepare(info)
    assert plan.why.endswith(f"; note: 5 of the 5 held-out rows ({sources['jsonl']}) have a training row's prompt")
    assert "note:" not in Completions(build_config(None, fields)).prepare(info).why  # (a seeded tenth: none)
