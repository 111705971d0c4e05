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
def test_eval_base_and_run(builtin_model, tmp_path, capsys):
    from localrl.cli import main

    assert main(["eval", "--eval-size", "40", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 40 and 0.1 <= report["accuracy"] <= 0.7
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--steps", "1", "--eval-size", "0", "--prompts-per-step", "2",
                 "--group-size", "2"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--eval-size", "40", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"].endswith("(step-000001)")


def test_models_list_shows_the_builtin(builtin_model):
    proc = localrl("models", "list")
    assert proc.returncode == 0 and proc.stdout.startswith("tiny-arith\t") and "\tbuilt" in proc.stdout


def test_the_progress_display_prints_lines_as_written_not_as_markup():
    from localrl.commands.progress import ProgressBar

    bar = ProgressBar(1)
    with bar.console.capture() as captured:
        bar({"kind": "status", "message": "rollouts: torch (pip install 'localrl[llama]' for llama.cpp)"})
    assert "'localrl[llama]'" in captured.get()


def test_the_eta_comes_from_the_steps_measured_even_when_a_step_takes_minutes():
    """rich's own estimate looks at the last 30 s: with 75 s steps it showed -:--:-- for the whole run."""
    from localrl.commands.progress import ProgressBar
    from localrl.metrics import eta_seconds

    steps = [{"kind": "train", "step": i, "reward_mean": 0.5, "accuracy": 0.5, "kl": None, "step_s": 70.0,
              "wall_time": 100.0 + 75.0 * i} for i in (1, 2, 3)]
    assert eta_seconds(steps[:1], 10) == 9 * 70.0  # one step: its own time
    assert eta_seconds(steps, 10) == 7 * 75.0  # more: the wall time between them (checkpoints count)
    assert eta_seconds([], 10) is None
    bar = ProgressBar(10)
    for record in steps:
        bar(record)
    eta_column = bar.progress.columns[-1]
    task = bar.progress.tasks[0]
    assert str(eta_column.render(task)) == "0:08:45"
    bar.close()


def test_evaluation_progress_moves_item_by_item_within_a_batch(builtin_model, monkeypatch):
    """``localrl eval --model X.gguf --eval-size 50`` sat at 0/50 for minutes: progress came per batch of 64."""
    from localrl import metrics
    from localrl.commands.eval import evaluate_policy
    from localrl.config import TrainConfig

    monkeypatch.setattr(metrics, "PROGRESS_SECONDS", 0.0)
    seen = []
    evaluate_policy(TrainConfig(eval_size=12, eval_batch_size=64).validate(), progress=lambda d, t: seen.append(d),
                    samples=0)
    assert seen[0] == 0 and seen[-1] == 12 and any(0 < d < 12 for d in seen), seen
    assert seen == sorted(seen)


@pytest.mark.parametrize("argv, message", [
    (["trian"], "unknown command 'trian' (did you mean train?)"),
    (["eval", "--eval-szie", "3"], "eval: unknown flag '--eval-szie' (did you mean --eval-size?)"),
    (["chat", "x", "--temprature", "1"], "chat: unknown flag '--temprature' (did you mean --temperature?)"),
    (["bench", "grpo-stpe"], "bench: unknown choice 'grpo-stpe' (did you mean grpo-step?)"),
    (["export", "x"], "export: the following arguments are required: --out (see localrl export -h)"),
])
def test_a_misspelt_command_or_flag_is_one_line_with_the_closest_valid_one(capsys, argv, message):
    from localrl.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"localrl: error: {message}"]


def test_every_help_entry_says_what_it_means():
    """`eval -h` once listed field names without meanings; every flag of every command has a help text."""
    from localrl.cli import build_parser

    import argparse

    parser = build_parser()
    commands = list(parser.commands.items())
    for name, sub in commands:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):  # bench NAME: each benchmark's own flags too
                commands += [(f"{name} {inner}", p) for inner, p in action.choices.items()]
            elif action.option_strings and action.dest != "help":
                assert action.help, f"localrl {name} {action.option_strings[0]}: no help text"
    assert "bench grpo-step" in dict(commands)
    eval_help = parser.commands["eval"].format_help()
    assert "--eval-size VALUE" in eval_help and "held-out problems" in eval_help


def test_a_before_and_after_on_different_eval_sizes_claims_no_difference():
    """A resume with another --eval-size printed "before 34.0% -> after 99.0% (+65 points)" across 200 and 50."""
    from localrl.commands.train import before_after_line

    from localrl.samplers.completions import Completions
    from localrl.samplers.episodes import Episodes

    same = before_after_line({"accuracy": 0.34, "n": 200}, {"accuracy": 0.99, "n": 200}, Completions.measure)
    assert same == "held-out accuracy (200 problems, greedy pass@1): before 34.0% -> after 99.0% (+65.0 points)"
    other = before_after_line({"accuracy": 0.34, "n": 200}, {"accuracy": 0.99, "n": 50}, Episodes.measure)
    assert "on 200 tasks -> after 99.0% on 50 tasks (different sets: not comparable" in other
    assert "points" not in other
