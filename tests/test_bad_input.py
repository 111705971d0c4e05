"""What a careless user can do, and the answer each gets: one line naming what and where, before any
weights load, with nothing written; and resume refusing what would be silently wrong.

The command line is called in-process (``localrl.cli.main``), exactly as the ``localrl`` script calls
it: an exception that is not a UserError escapes and fails the test, so a traceback cannot pass."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from localrl.errors import UserError
from localrl.runs import Run
from localrl.training.loop import resume_config, train
from tests.helpers import QUIET, one_line, run_cli, small, train_records


@pytest.fixture
def audit_dir(tmp_path, monkeypatch):
    """A working directory holding the audit's bad files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9?", "answer": 1}\n')
    (tmp_path / "huge.jsonl").write_text(json.dumps({"prompt": "x " * 5_000_000, "answer": 1}) + "\n")
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1? " * 30, "answer": 2}) + "\n")
    (tmp_path / "nan.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": NaN}\n')
    (tmp_path / "a-file").write_text("not a directory\n")
    return tmp_path


TRAIN_CASES = [
    (["--data", "latin1.jsonl"], "latin1.jsonl:1: not UTF-8 text (byte 0xe9"),
    (["--data", "huge.jsonl"], "huge.jsonl:1: the prompt is at least"),
    (["--data", "nan.jsonl"], "nan.jsonl:1: 'answer' must be a finite number (got nan)"),
    (["--data", "long.jsonl"], "long.jsonl:1: the prompt is"),
    (["--max-new-tokens", "5000"], "config field max_new_tokens: 5000 leaves no room for a prompt in the model's "
                                   "context of 256 tokens"),
    (["--group-size", "100000"], "lower group_size, prompts_per_step or max_new_tokens"),
    (["--lr", "inf"], "config field lr: must be a finite number"),
    (["--beta", "inf"], "config field beta: must be a finite number"),
    (["--temperature", "inf"], "config field temperature: must be a finite number"),
    (["--epsilon", "nan"], "config field epsilon: must be a finite number"),
    (["--memory-budget", "1e999GB"], "config field memory_budget: '1e999GB' is more memory than any machine has"),
    (["--run-dir", "a-file"], "run_dir a-file: is a file, not a directory"),
    (["--run-dir", "a-file/run"], "run_dir a-file/run: cannot be written"),
    (["--run-dir", "/proc/localrl-run"], "run_dir /proc/localrl-run: cannot be written"),
    (["--steps", "1.5"], "config field steps: expected int, got '1.5'"),
    (["--steps"], "flag --steps: needs a value"),
    (["--no-steps"], "flag --no-steps: steps is not a yes/no field"),
    (["--bogus", "1"], "train: unknown flag '--bogus' (see localrl train -h)"),
    (["--stpes", "3"], "train: unknown flag '--stpes' (did you mean --steps?)"),
    (["--resume", "a-file"], "resume a-file: not a run directory"),
    (["--resume", "nowhere"], "resume nowhere: no such directory"),
]


@pytest.mark.parametrize("args, message", TRAIN_CASES, ids=[" ".join(a) for a, _ in TRAIN_CASES])
def test_bad_train_input_is_one_line_and_writes_nothing(audit_dir, capsys, args, message):
    before = sorted(p.name for p in audit_dir.iterdir())
    code, err = run_cli(capsys, "train", *args)
    if message.startswith("unrecognized"):  # argparse's own answer: usage, then the error
        assert code == 2 and message in err[-1]
    else:
        assert code == 2 and len(err) == 1 and err[0].startswith("localrl: error: ") and message in err[0], err
    assert sorted(p.name for p in audit_dir.iterdir()) == before  # no run directory, no runs/, no stray file


def test_corrupted_weights_are_one_line(audit_dir, capsys, builtin_model):
    for name, damage in [("truncated", lambda b: b[: len(b) // 2]), ("random", lambda b: bytes(len(b)))]:
        model = audit_dir / name
        shutil.copytree(builtin_model, model)
        weights = model / "model.safetensors"
        weights.write_bytes(damage(weights.read_bytes()))
        line = one_line(capsys, "train", "--model", model, "--run-dir", "run")
        assert "model.safetensors is " + ("truncated" if name == "truncated" else "not a readable") in line
        line = one_line(capsys, "export", model, "--out", "x.gguf")
        assert "model.safetensors is" in line
    assert not (audit_dir / "run").exists() and not (audit_dir / "x.gguf").exists()


def test_truncated_and_foreign_gguf_files_are_one_line(audit_dir, capsys, builtin_model):
    from localrl.quant.export import export

    good = audit_dir / "m.gguf"
    export(builtin_model, good, "f16", check=False, log=lambda *_: None)
    data = good.read_bytes()
    (audit_dir / "cut.gguf").write_bytes(data[: len(data) // 2])
    (audit_dir / "header.gguf").write_bytes(data[:200])
    (audit_dir / "text.gguf").write_text("hello")
    assert "truncated GGUF" in one_line(capsys, "chat", "cut.gguf")
    assert "truncated GGUF" in one_line(capsys, "serve", "cut.gguf")
    assert "GGUF" in one_line(capsys, "chat", "header.gguf")
    assert "not a GGUF file" in one_line(capsys, "chat", "text.gguf")
    assert "no such file" in one_line(capsys, "chat", "missing.gguf")


def test_export_output_is_checked_before_the_model_loads(audit_dir, capsys, builtin_model, monkeypatch):
    import localrl.runs

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(localrl.runs, "load_merged", no_loading)
    (audit_dir / "folder.gguf").mkdir()
    assert "output folder.gguf is a directory" in one_line(capsys, "export", builtin_model, "--out", "folder.gguf")
    assert "cannot write a-file/x.gguf (a-file is a file" in one_line(capsys, "export", builtin_model, "--out",
                                                                     "a-file/x.gguf")
    assert "cannot write /proc/x.gguf" in one_line(capsys, "export", builtin_model, "--out", "/proc/x.gguf")
    assert "should end in .gguf" in one_line(capsys, "export", builtin_model, "--out", "x.bin")
    assert "unknown quant type 'q9'" in one_line(capsys, "export", builtin_model, "--out", "x.gguf", "--quant", "q9")
    assert sorted(p.name for p in audit_dir.iterdir()) == sorted(
        ["a-file", "folder.gguf", "huge.jsonl", "latin1.jsonl", "long.jsonl", "nan.jsonl"])


def test_an_export_stopped_during_validation_puts_nothing_in_place(tmp_path, builtin_model, monkeypatch):
    """The file is validated under its temporary name: stopped there, no unvalidated GGUF (or Modelfile)
    appears under the requested name, and the next export to that name removes what was left."""
    import localrl.quant.export as export_module

    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "check_gguf", stopped)
    with pytest.raises(KeyboardInterrupt):
        export_module.export(builtin_model, tmp_path / "m.gguf", "f16", log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    (tmp_path / ".tmp-f16-0123abcd-m.gguf").write_bytes(b"left by a kill")
    (tmp_path / ".tmp-m.Modelfile").write_text("left by a kill")
    result = export_module.export(builtin_model, tmp_path / "m.gguf", "f16", log=lambda *_: None)
    assert result.report.passed and sorted(p.name for p in tmp_path.iterdir()) == ["m.Modelfile", "m.gguf"]


def test_plan_and_baselines_bad_numbers_are_one_line(audit_dir, capsys):
    assert "budget" in one_line(capsys, "plan", "--prompt-len", "10", "--completion-len", "10", "--budget", "1e999GB")
    assert "--group >= 2" in one_line(capsys, "plan", "--prompt-len", "10", "--completion-len", "10", "--group", "1")
    assert one_line(capsys, "plan", "--prompt-len", "1000000000000", "--completion-len", "10") == (  # (53,599,476 GiB)
        "localrl: error: plan: --prompt-len 1000000000000 and --completion-len 10 make 1000000000010 tokens; "
        "tiny-arith holds 256")
    assert "--steps must be at least 16 (one step of each of the 16 games; got 15)" in one_line(
        capsys, "baselines", "pong", "--steps", "15")
    assert "--workers must be at least 1" in one_line(capsys, "baselines", "pong", "--workers", "0")
    assert "unknown choice 'dreamer'" in one_line(capsys, "baselines", "pong", "--agent", "dreamer")


# -- resume ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, builtin_model):
    """A 3-step run with checkpoints at steps 2 and 3 (copied by each test that damages it)."""
    run = tmp_path_factory.mktemp("runs") / "run"
    train(small(run, steps=3, save_every=1), **QUIET)
    assert [p.name for p in Run(run).checkpoints()] == ["step-000002", "step-000003"]
    return run


def copy_run(trained_run, tmp_path):
    return shutil.copytree(trained_run, tmp_path / "run")


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path)
    weights = run / "checkpoints" / "step-000003" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    lines = []
    result = train(resume_config(run, {"steps": 4}), resume=True, log=lines.append)
    assert any("step-000003: cannot be loaded" in line for line in lines)
    assert any("resumed" in line and "step-000002" in line and "newest that loads" in line for line in lines)
    assert result.steps_done == 4
    assert [r["step"] for r in train_records(run)] == [1, 2, 3, 4]  # step 3 recomputed, recorded once
    assert train_records(run)[:2] == train_records(trained_run)[:2]


def test_resume_refuses_a_checkpoint_whose_adapter_config_eval_and_export_would_refuse(trained_run, tmp_path):
    """The probe's: with a damaged adapter_config.json in the newest checkpoint, resume claimed it."""
    run = copy_run(trained_run, tmp_path)
    (run / "checkpoints" / "step-000003" / "adapter_config.json").write_text("{not json")
    lines = []
    result = train(resume_config(run, {"steps": 4}), resume=True, log=lines.append)
    assert any("step-000003: cannot be loaded" in line for line in lines), lines
    assert any("resumed" in line and "step-000002" in line for line in lines) and result.steps_done == 4


def test_a_half_deleted_checkpoint_is_never_under_a_valid_name(trained_run, tmp_path, monkeypatch):
    """Rotation renames before it deletes: a kill midway leaves a hidden leftover, removed on the next start."""
    import localrl.runs

    run = copy_run(trained_run, tmp_path)

    rmtree = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        if not Path(path).name.startswith(".old-step-"):  # anything else (temporary directories) as usual
            return rmtree(path, *args, **kwargs)
        (Path(path) / "adapter_model.safetensors").unlink()  # some files gone, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(localrl.runs.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        train(resume_config(run, {"steps": 4}), resume=True, **QUIET)
    monkeypatch.undo()
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names[0].startswith(".old-step-000002") and names[1:] == ["step-000003", "step-000004"]
    for ckpt in Run(run).checkpoints():  # everything under a step-* name is whole
        assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt"} <= {
            p.name for p in ckpt.iterdir()}
    train(resume_config(run, {"steps": 5}), resume=True, **QUIET)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004", "step-000005"]


def test_deleted_checkpoints_are_not_a_silent_restart(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path)
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(UserError, match="record a checkpoint at step 3, but checkpoints/ holds none; refusing"):
        train(resume_config(run, {"steps": 4}), resume=True, **QUIET)


def test_other_base_weights_of_the_same_shape_are_refused(trained_run, tmp_path, builtin_model):
    run = copy_run(trained_run, tmp_path)
    other = shutil.copytree(builtin_model, tmp_path / "other-model")
    weights = load_file(str(other / "model.safetensors"))
    save_file({k: v * 1.01 for k, v in weights.items()}, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="is not the base this run was trained on"):
        train(resume_config(run, {"model": str(other), "steps": 4}), resume=True, **QUIET)
    # the same weights under another path are the run's own
    same = shutil.copytree(builtin_model, tmp_path / "same-model")
    train(resume_config(run, {"model": str(same), "steps": 4}), resume=True, **QUIET)
    assert Run(run).steps_done() == 4


def test_a_failed_resume_changes_nothing(trained_run, tmp_path, capsys):
    run = copy_run(trained_run, tmp_path)
    (run / "checkpoints" / "step-000002" / "trainer_state.pt").write_bytes(b"x")
    (run / "checkpoints" / "step-000003" / "trainer_state.pt").write_bytes(b"x")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    line = one_line(capsys, "train", "--resume", run, "--lr", "0.5", "--steps", "9")
    assert "no checkpoint loads" in line
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # config.toml still the old one


@pytest.mark.parametrize("flag, value, saved", [("--lora-rank", "8", "16"), ("--lora-alpha", "8", "32"),
                                               ("--lora-targets", "q_proj", "'all-linear'")])
def test_resuming_with_another_adapter_is_one_line_naming_the_field(trained_run, capsys, flag, value, saved):
    """(With another rank, every checkpoint failed to load in turn, and lora_rank was never named.)"""
    field = flag[2:].replace("-", "_")
    line = one_line(capsys, "train", "--resume", trained_run, flag, value)
    assert line.startswith(f"localrl: error: config field {field}: the run's adapter was trained with {field} {saved}; "
                           f"a resumed run keeps it"), line


def test_a_run_killed_before_its_config_can_be_started_again(tmp_path, capsys, monkeypatch, builtin_model):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"  # what a kill -9 while the model loads leaves
    (run / "checkpoints" / ".tmp-step-000001-x").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "status", "stage": "load", "message": "loading"}) + "\n")
    line = one_line(capsys, "train", "--resume", "run")
    assert "the run stopped before it started" in line and "localrl train --run-dir run" in line
    code, _ = run_cli(capsys, "train", "--run-dir", "run", "--steps", "1", "--eval-size", "0",
                      "--prompts-per-step", "2", "--group-size", "2")
    assert code == 0 and Run(run).steps_done() == 1
    assert not list((run / "checkpoints").glob(".tmp-*"))
    # a folder of the user's that is not a run is never cleared
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert "not empty and not a run" in one_line(capsys, "train", "--run-dir", "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_second_train_or_resume_into_a_live_run_is_refused_and_the_first_keeps_its_files(trained_run, tmp_path,
                                                                                          capsys, monkeypatch):
    """The probe's race: a second run started while the first loads took the first's status records for a run that
    stopped before it started, and deleted them. A live run is told apart by its lock, whichever process holds it."""
    monkeypatch.chdir(tmp_path)
    loading = Run.create(tmp_path / "same", log=lambda *_: None)  # the first run, still loading its model
    (loading.path / "metrics.jsonl").write_text(json.dumps({"kind": "status", "stage": "load"}) + "\n")
    line = one_line(capsys, "train", "--run-dir", "same", "--steps", "1")
    assert f"in use by localrl process {os.getpid()}" in line
    assert (loading.path / "metrics.jsonl").exists()  # the first's files intact
    live = copy_run(trained_run, tmp_path)
    training = Run.open(live)
    training.acquire()  # the first, still training
    before = {p.name: p.read_bytes() for p in live.iterdir() if p.is_file()}
    assert "in use by localrl process" in one_line(capsys, "train", "--resume", live, "--steps", "9")
    assert {p.name: p.read_bytes() for p in live.iterdir() if p.is_file()} == before
    training.release()
    loading.release()  # once the first has ended, the directory is free again
    code, _ = run_cli(capsys, "train", "--resume", live, "--steps", "5")
    assert code == 0 and Run(live).steps_done() == 5


def test_ctrl_c_while_the_model_loads_leaves_nothing_and_says_so(tmp_path, monkeypatch, builtin_model):
    import localrl.training.loop

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(localrl.training.loop, "load_policy", interrupted)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        train(small(tmp_path / "runs" / "run", steps=1), log=lines.append)
    assert lines == ["interrupted before training started: nothing was saved"]
    assert not (tmp_path / "runs").exists()  # the directories it made are gone


# -- kill -9 -----------------------------------------------------------------------------------


def _spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "localrl", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "the process ended before the moment to kill it"
        assert time.monotonic() < deadline, "timed out waiting for the moment to kill"
        time.sleep(0.02)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()


@pytest.mark.slow
def test_kill_9_during_export_leaves_nothing_under_the_name_and_the_next_export_cleans_up(tmp_path, builtin_model):
    from localrl.quant.export import export

    out = tmp_path / "m.gguf"
    proc = _spawn("export", builtin_model, "--out", out, "--quant", "q4_k_m")
    _kill_when(proc, lambda: any(tmp_path.glob(".tmp-*")))
    assert not out.exists() and not out.with_suffix(".Modelfile").exists()
    assert any(tmp_path.glob(".tmp-*"))  # what the kill left (the f16 intermediate or the file itself)
    result = export(builtin_model, out, "q4_k_m", log=lambda *_: None)
    assert result.path == out and out.with_suffix(".Modelfile").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.Modelfile", "m.gguf"]


@pytest.mark.slow
def test_kill_9_while_loading_then_mid_run_resumes_like_an_uninterrupted_run(tmp_path, builtin_model):
    run = tmp_path / "run"
    flags = ["--run-dir", run, "--steps", "6", "--eval-size", "0", "--prompts-per-step", "4", "--group-size", "4",
             "--save-every", "1", "--seed", "7", "--max-new-tokens", "48"]
    metrics = Run(run).metrics_path
    # killed while the model loads: no config yet; started again in the same directory
    _kill_when(_spawn("train", *flags), lambda: metrics.exists() and "load" in metrics.read_text())
    assert not Run(run).config_path.exists()
    # killed mid-run, after a random number of steps (in a step, or in a checkpoint write)
    target = random.randint(2, 4)
    _kill_when(_spawn("train", *flags), lambda: len(train_records(run)) >= target)
    done = Run(run).steps_done()
    assert 1 <= done < 6
    train(resume_config(run), resume=True, **QUIET)
    reference = train(small(tmp_path / "ref", steps=6, save_every=1), **QUIET)
    assert train_records(run) == train_records(reference.run_dir)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_without_llama_cpp_training_and_plain_export_work_and_the_rest_says_how_to_get_it(
        tmp_path, capsys, builtin_model, monkeypatch):
    """llama-cpp-python is the ``llama`` extra: what needs it says so in one line, before any work."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    monkeypatch.chdir(tmp_path)
    for args in (["export", builtin_model, "--out", "a.gguf"], ["export", builtin_model, "--out", "k.gguf",
                                                                  "--quant", "q4_k_m"]):
        assert "needs llama-cpp-python, which is not installed (pip install 'localrl[llama]')" in one_line(
            capsys, *args)
    code, _ = run_cli(capsys, "export", builtin_model, "--out", "plain.gguf", "--no-check")
    assert code == 0 and (tmp_path / "plain.gguf").exists()
    assert "pip install 'localrl[llama]'" in one_line(capsys, "serve", "plain.gguf")
    assert "pip install 'localrl[llama]'" in one_line(capsys, "chat", "plain.gguf")
    code, _ = run_cli(capsys, "train", "--steps", "1", "--eval-size", "0", "--prompts-per-step", "2",
                      "--group-size", "2", "--run-dir", "run")
    assert code == 0


# -- the second audit: a user's rewards, models build, chat, a damaged base.json ----------------------

REWARDS = '''
import math
def boom(completions, **_):
    raise ValueError("my reward broke")
def short(completions, **_):
    return [1.0]
def words(completions, **_):
    return ["good"] * len(completions)
def nan(completions, **_):
    return [math.nan] * len(completions)
'''


@pytest.mark.parametrize("name, message", [
    ("boom", "reward boom failed: ValueError: my reward broke"),
    ("short", "reward short returned 1 scores for 2 completions"),
    ("words", "reward words returned a score that is not a number: 'good'"),
    ("nan", "reward nan returned nan for completion 0: scores must be finite"),
    ("os:getcwd", "reward getcwd failed: TypeError"),
])
def test_a_users_broken_reward_is_one_line_before_anything_is_written(audit_dir, capsys, monkeypatch, name, message):
    (audit_dir / "myrew.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(audit_dir))
    before = sorted(p.name for p in audit_dir.iterdir())
    spec = name if ":" in name else f"myrew:{name}"
    line = one_line(capsys, "train", "--reward", spec, "--steps", "1", "--eval-size", "2")
    assert message in line
    assert sorted(p.name for p in audit_dir.iterdir() if p.name != "__pycache__") == before


def test_models_build_never_replaces_what_is_not_a_built_model(audit_dir, capsys):
    (audit_dir / "mine").mkdir()
    (audit_dir / "mine" / "keep.txt").write_text("my work\n")
    assert "holds files that are not a built model" in one_line(capsys, "models", "build", "--out", "mine",
                                                                "--steps", "1")
    assert (audit_dir / "mine" / "keep.txt").read_text() == "my work\n"
    assert "is a file, not a directory" in one_line(capsys, "models", "build", "--out", "a-file", "--steps", "1")
    assert "--steps: must be at least 1" in one_line(capsys, "models", "build", "--out", "new", "--steps", "0")
    for action in (["build", "--steps", "1"], ["shape", "qwen2.5-0.5b"]):  # (torch took -1 as 2**64 - 1)
        assert one_line(capsys, "models", *action, "--out", "new", "--seed", "-1") == (
            f"localrl: error: models {action[0]} --seed: must be from 0 to 2**64 - 1 (got -1)")
    assert not (audit_dir / "new").exists()


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "inf"], "chat --temperature: must be a finite number"),
    (["--temperature", "-1"], "chat --temperature"),
    (["--n-ctx", "-1"], "chat: --n-ctx must be 0"),
])
def test_chat_flags_are_checked_in_one_line(audit_dir, capsys, flags, message):
    assert message in one_line(capsys, "chat", "tiny-arith", *flags)


def test_a_chat_longer_than_the_context_is_one_line(builtin_model):
    import io

    from localrl.serving.chat import terminal_chat

    with pytest.raises(UserError, match="too many for tiny-arith's context of 256"):  # one message alone
        terminal_chat("tiny-arith", stdin=io.StringIO("What is 1 + 1? " * 40 + "\n"), stdout=io.StringIO())


def test_a_damaged_base_record_stops_the_resume(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path)
    (run / "base.json").write_text("{")
    with pytest.raises(UserError, match="base.json is damaged"):
        train(resume_config(run, {"steps": 4}), resume=True, **QUIET)
    assert (run / "base.json").read_text() == "{"


# -- the third audit: a user's shell tasks, modules, libraries, config files, flags that did nothing --------

def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "__pycache__")


TASK_LINES = [
    ({"instruction": "x", "check": ["answer"]}, 'check: must be an object with some of answer, files, absent, dirs '
                                                '(got ["answer"])'),
    ({"instruction": "x", "check": "b.txt"}, 'check: must be an object with some of answer, files, absent, dirs '
                                             '(got "b.txt")'),
    ({"instruction": "x", "check": {"files": ["a.txt"]}}, 'check.files: must be an object mapping relative paths'),
    ({"instruction": "x", "check": {"files": {"a.txt": 1}}}, "check.files: the content of 'a.txt' must be a string "
                                                             "(got 1)"),
    ({"instruction": "x", "check": {"answer": 1}, "level": "2"}, 'level: must be a whole number, 0 or more (got "2")'),
    ({"instruction": "x", "check": {"answer": 1}, "level": 1.5}, "level: must be a whole number"),
    ({"instruction": "x", "check": {"absent": ["b.txt"]}, "solution": "rm b.txt"},
     'solution: must be a list of shell commands, each a non-empty string (got "rm b.txt")'),
    ({"instruction": "x", "check": {"answer": 1}, "solution": {"cmd": "ls"}}, "solution: must be a list"),
    ({"instruction": "x", "files": {"a": "1", "a/b": "2"}, "check": {"answer": 1}},
     "files: 'a' is a file, so 'a/b' cannot be inside it"),
    ({"instruction": "x", "files": {"a": "1", "a/": ""}, "check": {"answer": 1}}, "files: 'a' and 'a/' are the same"),
    ({"instruction": "x", "files": {"b.txt": "1"}, "check": {"absent": "b.txt"}},
     'check.absent: must be a list of relative paths (got "b.txt")'),
    ({"instruction": "x", "check": {"dirs": "out"}}, "check.dirs: must be a list of relative paths"),
    ({"instruction": "x", "check": {"answer": None, "files": {}}}, None),  # valid: a check that always scores 0
]


@pytest.mark.parametrize("row, message", TASK_LINES, ids=[m or "valid" for _, m in TASK_LINES])
def test_bad_env_task_lines_are_one_line_naming_file_line_and_field(audit_dir, capsys, row, message):
    (audit_dir / "tasks.jsonl").write_text(json.dumps({"instruction": "ok", "check": {"answer": 1}}) + "\n"
                                           + json.dumps(row) + "\n")
    before = _listing(audit_dir)
    if message is None:
        from localrl.envs.task_files import load_tasks

        assert len(load_tasks("tasks.jsonl")) == 2
        return
    for command in ("train", "sft"):
        line = one_line(capsys, command, "--env", "shell", "--env-tasks", "tasks.jsonl", "--run-dir", "run")
        assert f"tasks.jsonl:2: {message}" in line
    assert _listing(audit_dir) == before


USER_MODULES = {
    "syntax_bad": "def tasks(:\n    pass\n",
    "import_boom": "x = 1\nraise RuntimeError('configured wrong at import')\n",
    "import_exit": "import sys\nsys.exit(3)\n",
    "import_missing_dep": "import no_such_dependency_xyz\n",
    "task_fns": ("def boom():\n    raise ValueError('no tasks today')\n"
                 "def number():\n    return 5\n"
                 "def empty():\n    return []\n"
                 "def words():\n    return ['a task']\n"),
}


@pytest.mark.parametrize("spec, message", [
    ("syntax_bad:tasks", "tasks 'syntax_bad:tasks': importing syntax_bad failed: SyntaxError: "),
    ("import_boom:tasks", "importing import_boom failed: RuntimeError: configured wrong at import ("),
    ("import_exit:tasks", "importing import_exit failed: SystemExit: 3"),
    ("import_missing_dep:tasks", "cannot import it (No module named 'no_such_dependency_xyz')"),
    ("task_fns:missing", "cannot import it (module 'task_fns' has no attribute 'missing')"),
    ("task_fns:boom", "tasks task_fns:boom: calling boom() failed: ValueError: no tasks today ("),
    ("task_fns:number", "tasks task_fns:number: calling number() failed: TypeError: 'int' object is not iterable"),
    ("task_fns:empty", "must return a non-empty list of localrl.envs.shell_tasks.ShellTask"),
    ("task_fns:words", "must return a non-empty list of localrl.envs.shell_tasks.ShellTask"),
])
def test_a_users_broken_task_module_is_one_line(audit_dir, capsys, monkeypatch, spec, message):
    for name, source in USER_MODULES.items():
        (audit_dir / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(audit_dir))
    before = _listing(audit_dir)
    line = one_line(capsys, "train", "--env", "shell", "--env-tasks", spec, "--run-dir", "run")
    assert message in line
    if "SyntaxError" in message:
        assert "syntax_bad.py:1)" in line
    assert _listing(audit_dir) == before


@pytest.mark.parametrize("module, message", [
    ("syntax_bad", "reward 'syntax_bad:f': importing syntax_bad failed: SyntaxError: "),
    ("import_boom", "reward 'import_boom:f': importing import_boom failed: RuntimeError: configured wrong at import"),
    ("import_exit", "importing import_exit failed: SystemExit: 3"),
])
def test_a_users_broken_reward_module_is_one_line(audit_dir, capsys, monkeypatch, module, message):
    (audit_dir / f"{module}.py").write_text(USER_MODULES[module])
    monkeypatch.syspath_prepend(str(audit_dir))
    before = _listing(audit_dir)
    assert message in one_line(capsys, "train", "--reward", f"{module}:f", "--run-dir", "run")
    assert _listing(audit_dir) == before


VERIFIERS = '''
import math, time
from localrl.envs.shell_tasks import Check, ShellTask

def _task(check, solution=("echo hi > out.txt",)):
    return [ShellTask("Write hi into out.txt.", {"a.txt": "1\\n"}, check, solution=solution)]

def raises():
    return _task(lambda root, text: (root / "missing.txt").read_text())
def nan():
    return _task(lambda root, text: math.nan)
def words():
    return _task(lambda root, text: "good", solution=())
def sleeps():
    return _task(lambda root, text: time.sleep(60))
def fine():
    return _task(lambda root, text: float((root / "out.txt").read_text().strip() == "hi"))
def bad_check():
    return _task(Check(files={"out.txt": 5}))
'''


@pytest.mark.parametrize("name, message", [
    ("raises", "task 1 ('Write hi into out.txt.'): its verifier, on the end state of its expert solution, failed: "
               "FileNotFoundError: "),
    ("nan", "its verifier, on the end state of its expert solution, returned nan: a score must be a finite number"),
    ("words", "its verifier, on the unchanged starting files, returned 'good', not a number"),
    ("sleeps", "its verifier, on the end state of its expert solution, did not return within 0.5 s"),
    ("bad_check", "failed: AttributeError: 'int' object has no attribute 'rstrip'"),
])
def test_a_users_broken_verifier_stops_the_run_before_anything_is_written(audit_dir, capsys, monkeypatch, name,
                                                                          message):
    import localrl.envs.shell

    (audit_dir / "verifiers.py").write_text(VERIFIERS)
    monkeypatch.syspath_prepend(str(audit_dir))
    monkeypatch.setattr(localrl.envs.shell, "VERIFIER_PROBE_SECONDS", 0.5)
    before = _listing(audit_dir)
    line = one_line(capsys, "train", "--env", "shell", "--env-tasks", f"verifiers:{name}", "--run-dir", "run")
    assert f"tasks verifiers:{name}: " in line and message in line
    assert _listing(audit_dir) == before


def test_a_working_verifier_passes_the_preflight(audit_dir, monkeypatch):
    from localrl.training.loop import preflight
    from localrl.training.settings import build_config

    (audit_dir / "verifiers.py").write_text(VERIFIERS)
    monkeypatch.syspath_prepend(str(audit_dir))
    pre = preflight(build_config(None, {"env": "shell", "env_tasks": "verifiers:fine", "run_dir": "run"}))
    assert pre.sampler.setup is not None and not (audit_dir / "run").exists()


def test_an_experience_library_that_is_not_utf8_is_one_line(audit_dir, capsys):
    (audit_dir / "lessons.txt").write_bytes(b"Check the units.\nCaf\xe9 lessons\n")
    (audit_dir / "experience.json").write_bytes(b'{"lessons": {"1": "caf\xe9"}}')
    assert "experience lessons.txt:2: not UTF-8 text (byte 0xe9)" in one_line(capsys, "chat", "tiny-arith",
                                                                               "--experience", "lessons.txt")
    assert "experience lessons.txt:2: not UTF-8 text" in one_line(capsys, "eval", "--experience", "lessons.txt",
                                                                  "--eval-size", "2")
    before = _listing(audit_dir)
    line = one_line(capsys, "train", "--objective", "experience", "--experience-init", "experience.json",
                    "--run-dir", "run")
    assert "config field experience_init: experience experience.json:1: not UTF-8 text (byte 0xe9)" in line
    assert _listing(audit_dir) == before


def _fake_run(path: Path, steps: int = 8, **fields) -> Path:
    """A run directory as training leaves it: its config and ``steps`` train records (no checkpoint), whose reward
    jumps halfway (a curve whose fit overflows numpy's powers)."""
    from localrl.config import TrainConfig
    from localrl.config_io import to_toml

    path.mkdir()
    (path / "config.toml").write_text(to_toml(TrainConfig(run_dir=str(path), steps=steps, **fields)))
    records = [{"kind": "train", "step": s, "reward_mean": 0.1 if s <= steps // 2 else 0.9, "accuracy": 0.5,
                "completions": 16, "completion_len": 20.0, "wall_time": float(s)} for s in range(1, steps + 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_analyze_checks_its_output_before_the_fit_and_fits_without_warnings(audit_dir, capsys, monkeypatch):
    import warnings

    import localrl.evaluation.analyze

    run = _fake_run(audit_dir / "run")
    real_fit = localrl.evaluation.analyze.fit_sigmoid

    def no_fit(*a, **k):
        raise AssertionError("fitted before the output was checked")

    monkeypatch.setattr(localrl.evaluation.analyze, "fit_sigmoid", no_fit)
    assert "analyze --out missing/s.png: no such directory missing" in one_line(capsys, "analyze", run, "--out",
                                                                                 "missing/s.png")
    assert "analyze --out run: must be a .png file" in one_line(capsys, "analyze", run, "--out", "run")
    assert "--samples must be at most 100,000 (got 10000000000)" in one_line(capsys, "analyze", run, "--samples",
                                                                             "10000000000")
    monkeypatch.setattr(localrl.evaluation.analyze, "fit_sigmoid", real_fit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warnings included
        code, err = run_cli(capsys, "analyze", run, "--out", "s.png", "--samples", "20")
    assert code == 0 and err == [] and (audit_dir / "s.png").is_file()


@pytest.mark.parametrize("content, message", [
    (b"train = 5\n", "config file c.toml: 'train' must be a [train] table of fields (got 5)"),
    (b"steps = 1\nrun_dir = \"caf\xe9\"\n", "c.toml:2: not UTF-8 text (byte 0xe9); TOML files are UTF-8"),
    (b"steps = 1\n\n[train]\nlr = 0.01\n", "config file c.toml: has fields both at the top level (steps) and in a "
                                          "[train] table; put them all in one place"),
])
def test_bad_config_files_are_one_line(audit_dir, capsys, content, message):
    (audit_dir / "c.toml").write_bytes(content)
    before = _listing(audit_dir)
    assert message in one_line(capsys, "train", "--config", "c.toml")
    assert _listing(audit_dir) == before


def test_a_config_file_with_a_byte_order_mark_is_read(audit_dir):
    from localrl.training.settings import build_config

    (audit_dir / "bom.toml").write_bytes(b"\xef\xbb\xbf[train]\nsteps = 3\n")
    (audit_dir / "bom-top.toml").write_bytes(b"\xef\xbb\xbfsteps = 4\n")
    assert build_config("bom.toml").steps == 3 and build_config("bom-top.toml").steps == 4


@pytest.mark.parametrize("args, message", [
    (["sft", "--env", "shell", "--data", "latin1.jsonl"], "config field data: is for single-turn prompts; an "
                                                          "environment's tasks come from env_tasks (got 'latin1.jsonl')"),
    (["train", "--env", "shell", "--eval-data", "x.jsonl"], "config field eval_data: is for single-turn prompts"),
    (["train", "--markovian-carry", "4"], "config field markovian_carry: needs markovian_chunk (Markovian thinking "
                                          "is off while markovian_chunk is 0) (got 4)"),
    (["train", "--markovian-chunk", "0", "--markovian-carry", "4"], "config field markovian_carry: needs"),
    (["train", "--steps", "100000000000000000000"], "config field steps: 100000000000000000000 is more than any run "
                                                    "needs (at most 1,000,000,000)"),
    (["train", "--lora-rank", "10000000000"], "config field lora_rank: 10000000000 is more than any run needs"),
    (["train", "--eval-size", "-99999999999"], "config field eval_size: must be non-negative"),
    (["train", "--seed", "2" + "0" * 30], "config field seed: must be from 0 to 4,294,967,295 (got 2000"),
    (["train", "--seed", "-1"], "config field seed: must be from 0 to 4,294,967,295 (got -1)"),
])
def test_settings_that_would_be_ignored_or_absurd_are_refused(audit_dir, capsys, args, message):
    before = _listing(audit_dir)
    assert message in one_line(capsys, *args, "--run-dir", "run")
    assert _listing(audit_dir) == before


def test_eval_of_a_run_in_another_setting_is_refused(audit_dir, capsys):
    run = _fake_run(audit_dir / "arith-run")
    line = one_line(capsys, "eval", run, "--env", "shell")
    assert ("the run was trained on single-turn prompts (arith); evaluating it in the shell environment measures "
            "nothing it learned") in line


def test_serve_of_a_directory_says_it_is_one(audit_dir, capsys):
    (audit_dir / "folder").mkdir()
    assert "folder: is a directory, not a .gguf file" in one_line(capsys, "serve", "folder")


def test_the_agent_refuses_root_and_the_home_directory(audit_dir, capsys, monkeypatch):
    from localrl.agent.session import check_workdir

    home = audit_dir / "home" / "me"
    (home / "project").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    for workdir, what in [("/", "the root directory"), (home, "your home directory"),
                          (audit_dir / "home", f"a folder holding your home directory ({home})"), ("~", "your home")]:
        line = one_line(capsys, "agent", "tiny-shell", "tidy up", "--workdir", workdir)
        assert f"agent --workdir {workdir}: is {what}" in line and "--force-workdir" in line
    assert check_workdir(home / "project") == (home / "project").resolve()
    assert check_workdir("/", force=True) == Path("/")
    assert "not a directory" in one_line(capsys, "agent", "tiny-shell", "x", "--workdir", "a-file")


def test_past_the_first_tasks_verifiers_are_probed_on_the_starting_files(audit_dir, monkeypatch):
    import localrl.envs.shell
    from localrl.envs.task_files import load_tasks

    (audit_dir / "verifiers.py").write_text(VERIFIERS)
    monkeypatch.syspath_prepend(str(audit_dir))
    monkeypatch.setattr(localrl.envs.shell, "PROBE_SOLUTIONS", 0)
    with pytest.raises(UserError, match=r"its verifier, on the unchanged starting files, failed: FileNotFoundError: "
                                        r".* \(verifiers.py:9\)"):
        localrl.envs.shell.probe_verifiers("verifiers:raises", load_tasks("verifiers:raises"), "process", 5.0)


# -- a full disk: one line, the last good state named, nothing torn ------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MB file system (tmpfs) to fill up; mounting needs root (CI runs as root)."""
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` until about ``leave`` bytes are free."""
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "ab") as f:
        f.write(b"\0" * max(0, free - leave))


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_last_good_one(builtin_model, small_disk):
    run_dir = small_disk / "run"

    def fill_after_the_first_checkpoint(record):
        if record.get("kind") == "checkpoint" and record["step"] == 1:
            fill(small_disk, 64 * 1024)  # room for metrics lines, not for a checkpoint

    with pytest.raises(UserError) as info:
        train(small(run_dir, steps=2, save_every=1), listeners=[fill_after_the_first_checkpoint], **QUIET)
    message = str(info.value)
    assert "could not write checkpoint step-000002" in message and "step-000001" in message
    assert "\n" not in message
    run = Run(run_dir)
    assert [p.name for p in run.checkpoints()] == ["step-000001"]
    assert not [p for p in run.checkpoints_dir.iterdir() if p.name.startswith(".tmp-")]
    (small_disk / "filler").unlink()
    resumed = train(resume_config(run_dir, {"steps": 2}), resume=True, **QUIET)  # the last good one resumes
    assert [r["step"] for r in train_records(resumed.run_dir)] == [1, 2]


def test_a_full_disk_during_a_metrics_append_leaves_no_torn_line(small_disk):
    from localrl.metrics import MetricsSink, read_metrics

    path = small_disk / "metrics.jsonl"
    sink = MetricsSink(path)
    sink.emit({"kind": "train", "step": 1})
    fill(small_disk, 0)
    with pytest.raises(UserError, match="could not append to .*metrics.jsonl"):
        sink.emit({"kind": "train", "step": 2, "text": "x" * 100_000})
    sink.close()  # nothing buffered is left to fail a second time
    assert path.read_text() == '{"kind": "train", "step": 1}\n'
    assert read_metrics(path) == [{"kind": "train", "step": 1}]


def test_a_full_disk_during_export_is_one_line(builtin_model, small_disk, capsys):
    fill(small_disk, 256 * 1024)
    line = one_line(capsys, "export", builtin_model, "--out", small_disk / "tiny.gguf", "--quant", "f16", "--no-check")
    assert "no space left writing" in line and "nothing was left behind" in line
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]  # no temporary left behind


def test_damaged_lines_in_metrics_cost_only_themselves(trained_run, tmp_path, capsys):
    """The probe's: one such line gave analyze and plot a traceback and failed a resume after the model loaded."""
    from localrl.metrics import read_metrics

    run = copy_run(trained_run, tmp_path)
    good = read_metrics(run / "metrics.jsonl")
    analyzed = run_cli(capsys, "analyze", str(run), "--json")
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(b"\xff\xfe not UTF-8\n5\n[1,2]\n" b'{"step": "two", "rewards": 5}\n{"kind": "train", "step": "x"}\n'
                b'{"kind": "train", "step": 9, "rewards": 5}\n')
    assert read_metrics(run / "metrics.jsonl") == good
    assert run_cli(capsys, "analyze", str(run), "--json") == analyzed  # as if the lines were not there
    assert run_cli(capsys, "plot", str(run), "--out", str(tmp_path / "p.png"))[0] == 0
    code, _ = run_cli(capsys, "train", "--resume", str(run), "--steps", "5")
    assert code == 0 and Run(run).steps_done() == 5
