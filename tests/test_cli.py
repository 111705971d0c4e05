"""The command line: bad input stops with one clear line before heavy work; eval reports accuracy."""

import json

import pytest

from tests.helpers import localrl


def _gpt2_dir(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return d


@pytest.mark.slow
@pytest.mark.parametrize("make_args, message", [
    (lambda t: ["--model", str(t / "missing")], "no such directory, and not a built-in model"),
    (lambda t: ["--model", str(_gpt2_dir(t))], "unsupported architecture 'gpt2'; supported: llama, mistral"),
    (lambda t: ["--data", str(t / "e.jsonl")], "no rows"),
    (lambda t: ["--data", str(t / "bad.jsonl")], "bad.jsonl:2: missing 'answer'"),
    (lambda t: ["--group-size", "1"], "config field group_size: must be at least 2"),
    (lambda t: ["--max-new-tokens", "0"], "config field max_new_tokens: must be at least 1"),
    (lambda t: ["--config", str(t / "nope.toml")], "nope.toml: not found"),
    (lambda t: ["--resume", str(t)], "not a run directory"),
])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, make_args, message):
    (tmp_path / "e.jsonl").write_text("\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b"}\n')
    args = make_args(tmp_path)
    before = set(tmp_path.iterdir())
    proc = localrl("train", *args, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localrl: error:") and message in lines[0], proc.stderr
    assert set(tmp_path.iterdir()) == before  # no run directory, no stray files


@pytest.mark.slow
def test_eval_base_and_run(builtin_model, tmp_path):
    base = localrl("eval", "--eval-size", "40", "--json")
    assert base.returncode == 0, base.stderr
    report = json.loads(base.stdout)
    assert report["n"] == 40 and 0.1 <= report["accuracy"] <= 0.7
    run = tmp_path / "run"
    trained = localrl("train", "--run-dir", str(run), "--steps", "1", "--eval-size", "0", "--prompts-per-step", "2",
                      "--group-size", "2")
    assert trained.returncode == 0, trained.stderr
    after = localrl("eval", str(run), "--eval-size", "40", "--json")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["model"].endswith("(step-000001)")


def test_models_list_shows_the_builtin(builtin_model):
    proc = localrl("models", "list")
    assert proc.returncode == 0 and proc.stdout.startswith("tiny-arith\t") and "\tbuilt" in proc.stdout


def test_the_progress_display_prints_lines_as_written_not_as_markup():
    from localrl.cli import ProgressBar

    bar = ProgressBar(1)
    with bar.console.capture() as captured:
        bar({"kind": "status", "message": "rollouts: torch (pip install 'localrl[llama]' for llama.cpp)"})
    assert "'localrl[llama]'" in captured.get()
