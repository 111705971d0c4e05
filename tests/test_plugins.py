"""Plug-ins from outside localrl: an objective and an environment defined and registered in this test module
train from the command line (``--objective``, ``--env``) with no edit anywhere in localrl; and the loop
itself names no objective, sampler or environment."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from localrl.config import FIELDS, setting
from localrl.envs import EnvSetup, environments
from localrl.errors import UserError
from localrl.objectives import Objective, objectives
from localrl.samplers import samplers

ROOT = Path(__file__).resolve().parents[1]


# -- a test-local objective: supervised steps on the task's own answers --------------------------------------

class Answers(Objective):
    """Minimise the negative log-likelihood of ``<answer>{answer}</answer>`` after each prompt of a fixed batch
    of the task's rows (the same rows every step, so the loss must fall)."""

    sample_rewards = False

    def step(self, ctx, step, tokens):
        from localrl.generation.rollout import encode_prompts

        rows = ctx.sampler.task.sample(0, self.rows(), self.cfg.seed)
        prompts = encode_prompts(ctx.tok, rows, ctx.sampler.task.system)
        targets = [ctx.tok(f"<answer>{r['answer']}</answer>", add_special_tokens=False)["input_ids"] for r in rows]
        ctx.model.train()
        ctx.optimizer.zero_grad()
        total = 0.0
        for prompt, target in zip(prompts, targets):
            ids = torch.tensor([prompt + target], device=ctx.device)
            logits = ctx.model(ids).logits[0, len(prompt) - 1:-1]
            loss = torch.nn.functional.cross_entropy(logits.float(), ids[0, len(prompt):]) * self.scale() / len(rows)
            loss.backward()
            total += loss.item()
        ctx.optimizer.step()
        return {"kind": "train", "step": step + 1, "loss": total, "rows": len(rows), "scale": self.scale()}

    def rows(self) -> int:
        return self.cfg.prompts_per_step

    def scale(self) -> float:
        return 1.0


@dataclass
class RowsSettings:
    """supervised steps on a few of the task's rows"""

    answer_rows: int = setting(4, "objective rows: the task's rows each step trains on")
    answer_scale: float = setting(1.0, "objective rows: the factor on each step's loss")


class Rows(Answers):
    """Answers' steps on ``answer_rows`` rows, the loss times ``answer_scale``: an objective with settings, a preset
    and a check of its own, all in this file."""

    settings = RowsSettings
    preset = {"eval_size": 8}

    @staticmethod
    def check_settings(cfg) -> None:
        from localrl.config import check_fields

        check_fields(cfg, [("answer_rows", cfg.answer_rows >= 1, "must be at least 1"),
                           ("answer_scale", cfg.answer_scale > 0, "must be positive")])

    def rows(self) -> int:
        return self.cfg.answer_rows

    def scale(self) -> float:
        return self.cfg.answer_scale


# -- a test-local environment: say as many different letters as you can, in one turn --------------------------

@dataclass
class Word:
    instruction: str
    family: str


class Letters:
    """One turn: the reward is the share of the 26 letters the reply uses (a score that varies, so GRPO has a
    signal from the first step)."""

    def __init__(self, tasks):
        self.tasks, self.task, self.text = tasks, None, ""

    def reset(self, seed: int) -> str:
        self.task = self.tasks(seed)
        return self.task.instruction

    def step(self, action: str) -> tuple[str, bool]:
        self.text = action
        return "", True

    def reward(self) -> float:
        return len({c for c in self.text.lower() if c.isalpha()}) / 26

    def close(self) -> None:
        pass


def letters_environment(cfg) -> EnvSetup:
    words = ["apple", "river", "stone", "cloud", "ember", "frost", "grove", "lumen"]
    tasks = [Word(f"Write a sentence about {w}.", family=("a-m" if w < "n" else "n-z")) for w in words]
    return EnvSetup(train=lambda seed: tasks[seed % len(tasks)], held_out=tasks[:4], factory=Letters)


def check_letters(cfg) -> None:
    """The environment's own settings check: one turn is all it has."""
    from localrl.config import check_fields

    check_fields(cfg, [("max_turns", cfg.env != "letters" or cfg.max_turns == 1, "letters is one turn: must be 1")])


@pytest.fixture
def registered():
    """The test's own objective and environment, registered for the test and forgotten after it."""
    objectives.register("answers", Answers)
    environments.register("letters", letters_environment, preset={"model": "tiny-shell", "max_turns": 1},
                          check=check_letters)
    yield
    objectives.unregister("answers")
    environments.unregister("letters")


def _adapter(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    from localrl.runs import Run

    return load_file(str(Run(run_dir).latest_checkpoint() / "adapter_model.safetensors"))


def test_a_test_local_objective_trains_from_the_cli(registered, builtin_model, tmp_path, capsys):
    from localrl.cli import main
    from localrl.metrics import read_metrics
    from localrl.runs import Run

    run = tmp_path / "run"
    assert main(["train", "--objective", "answers", "--steps", "3", "--prompts-per-step", "4", "--eval-size", "8",
                 "--run-dir", str(run), "--rollout", "torch"]) == 0
    records = read_metrics(Run(run).metrics_path)
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[-1]["loss"] < steps[0]["loss"]  # the same rows each step: its loss falls
    assert [r["when"] for r in records if r["kind"] == "eval"] == ["before", "after"]  # the loop's, as any run's
    assert any(v.abs().sum() > 0 for k, v in _adapter(run).items() if "lora_B" in k)
    assert "held-out accuracy" in capsys.readouterr().out


def test_an_objective_with_settings_is_one_file_from_flags_toml_and_help(builtin_model, tmp_path, capsys):
    """An objective registered from this module brings two settings (a flag and a TOML key each, a section of
    ``localrl train -h``), a preset and a check; a field of it set while another objective is selected is one line."""
    from localrl.cli import main
    from localrl.metrics import read_metrics
    from localrl.runs import Run

    objectives.register("rows", Rows)
    try:
        with pytest.raises(SystemExit):
            main(["train", "-h"])
        assert ("objective rows (supervised steps on a few of the task's rows):\n  --answer-rows VALUE"
                in capsys.readouterr().out)
        toml, run = tmp_path / "rows.toml", tmp_path / "run"
        toml.write_text('objective = "rows"\nanswer_scale = 0.5\n')
        assert main(["train", "--config", str(toml), "--answer-rows", "2", "--steps", "2", "--rollout", "torch",
                     "--run-dir", str(run)]) == 0
        records = read_metrics(Run(run).metrics_path)
        assert [(r["rows"], r["scale"]) for r in records if r["kind"] == "train"] == [(2, 0.5), (2, 0.5)]
        assert [r["n"] for r in records if r["kind"] == "eval"] == [8, 8]  # its preset's eval_size
        saved = Run(run).read_config()
        assert (saved.answer_rows, saved.answer_scale, saved.eval_size) == (2, 0.5, 8)
        for argv, line in [(["--answer-rows", "3"], "config field answer_rows: needs objective rows"),
                           (["--objective", "rows", "--answer-rows", "0"],
                            "config field answer_rows: must be at least 1 (got 0)")]:
            assert main(["train", *argv, "--run-dir", str(tmp_path / "refused")]) == 2
            assert capsys.readouterr().err == f"localrl: error: {line}\n"
        assert not (tmp_path / "refused").exists()
    finally:
        objectives.unregister("rows")


def test_a_test_local_environment_trains_by_grpo_from_the_cli(registered, tmp_path, capsys):
    from localrl.cli import main
    from localrl.metrics import read_metrics
    from localrl.runs import Run

    run = tmp_path / "run"
    assert main(["train", "--env", "letters", "--model", "tiny-shell", "--steps", "2", "--prompts-per-step", "2",
                 "--group-size", "4", "--max-turns", "1", "--max-new-tokens", "24", "--eval-size", "4",
                 "--run-dir", str(run)]) == 0
    records = read_metrics(Run(run).metrics_path)
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2] and all(r["reward_std"] > 0 for r in steps)
    after = next(r for r in records if r["kind"] == "eval" and r["when"] == "after")
    assert after["n"] == 4 and set(after["families"]) == {"a-m", "n-z"} and 0 < after["reward_mean"] < 1
    assert any(v.abs().sum() > 0 for k, v in _adapter(run).items() if "lora_B" in k)
    assert "held-out success" in capsys.readouterr().out


def test_a_plugin_brings_its_preset_and_checks_its_own_settings(registered, tmp_path, capsys):
    from localrl.cli import main
    from localrl.training.settings import build_config

    assert (build_config(None, {"env": "letters"}).model, build_config(None, {"env": "letters"}).max_turns) == \
        ("tiny-shell", 1)
    assert build_config(None, {"env": "letters", "model": "tiny-arith"}).model == "tiny-arith"  # a flag wins
    assert build_config(None, {}).model == "tiny-arith"  # another environment's preset never applies
    assert main(["train", "--env", "letters", "--max-turns", "3", "--run-dir", str(tmp_path / "r")]) == 2
    assert "config field max_turns: letters is one turn: must be 1 (got 3)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@dataclass
class RanksSettings:
    """a test module's own"""

    ranks_margin: float = setting(0.0, "objective ranks: a margin it refuses above 1")


class Ranks(Answers):
    """A test-local objective that declares its advantages group-relative, has a setting, and refuses a value of it
    when the run selects it."""

    group_relative = True
    settings = RanksSettings

    @staticmethod
    def check_selected(cfg) -> None:
        from localrl.config import check_fields

        check_fields(cfg, [("ranks_margin", cfg.ranks_margin <= 1, "ranks: must be at most 1")])


def test_samplers_ask_capabilities_and_an_unselected_plugins_field_is_refused(registered):
    """A sampler that shapes the groups (a prefix tree) takes any objective that declares ``group_relative``,
    a test-local one included, and refuses one that does not in one line naming those that can; a field a plug-in
    ``owns`` is refused for every other selection, once, by the registry; its ``check_selected`` runs only when the
    run selects it."""
    from localrl.training.settings import build_config

    objectives.register("ranks", Ranks)
    try:
        assert build_config(None, {"objective": "ranks", "sampler": "prefix_tree"}).objective == "ranks"
        with pytest.raises(UserError, match=r"^config field objective: answers cannot train with sampler prefix_tree "
                                            r"\(its advantages are GRPO's, staged over the tree; objectives that can: "
                                            r"contrastive_grpo, grpo, ranks, turn_grpo\)"):
            build_config(None, {"objective": "answers", "sampler": "prefix_tree"})
        assert build_config(None, {"objective": "ranks", "ranks_margin": 0.5}).ranks_margin == 0.5
        assert build_config(None, {"objective": "contrastive_grpo", "contrastive_margin": 0.5}).contrastive_margin == 0.5
        with pytest.raises(UserError, match=r"^config field ranks_margin: needs objective ranks$"):
            build_config(None, {"objective": "answers", "ranks_margin": 0.5})
        with pytest.raises(UserError, match=r"^config field contrastive_margin: needs objective contrastive_grpo$"):
            build_config(None, {"objective": "ranks", "contrastive_margin": 0.5})
        with pytest.raises(UserError, match=r"^config field ranks_margin: ranks: must be at most 1 \(got 2"):
            build_config(None, {"objective": "ranks", "ranks_margin": 2})
    finally:
        objectives.unregister("ranks")
    assert "ranks_margin" not in FIELDS  # an unregistered plug-in's settings are gone with it
    with pytest.raises(UserError, match=r"^unknown config field 'ranks_margin'$"):
        build_config(None, {"ranks_margin": 0.5})


def test_two_samplers_claiming_one_config_is_one_line_never_a_pick_by_module_order():
    """A user's sampler that claims every config with an env, beside the built-in episodes sampler: the config
    must name one; named, or alone in its claim, it is taken. The bases declare what a plug-in must write."""
    import inspect

    from localrl.samplers import Sampler, sampler_for
    from localrl.samplers.completions import Completions
    from localrl.training.settings import build_config

    class Everything(Completions):
        @classmethod
        def selects(cls, cfg) -> bool:
            return True

    samplers.register("everything", Everything)
    try:
        with pytest.raises(UserError, match=r"^config field sampler: samplers episodes, everything each claim this "
                                            r"config; name one \(--sampler NAME\)$"):
            build_config(None, {"env": "shell"})
        assert sampler_for(build_config(None, {"env": "shell", "sampler": "everything"})) is Everything
        assert sampler_for(build_config(None, {})) is Everything  # the only claim
    finally:
        samplers.unregister("everything")
    assert Sampler.__abstractmethods__ == {"prepare", "sample", "evaluate"}
    assert Objective.__abstractmethods__ == {"step"}
    assert "stops" in inspect.signature(Sampler.evaluate).parameters


def test_an_unknown_plugin_is_one_line_naming_the_field(registered, tmp_path, capsys):
    from localrl.cli import main

    assert main(["train", "--objective", "nope", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "config field objective: 'nope' is not a known objective (one of answers, contrastive_grpo, dpo, experience, grpo" in err
    assert not (tmp_path / "r").exists()
    assert main(["train", "--env", "nope", "--run-dir", str(tmp_path / "r")]) == 2
    assert "config field env: must be empty or one of letters, secret_keeping, shell" in capsys.readouterr().err


def test_a_plugin_that_takes_an_argument_is_named_name_colon_argument():
    from localrl.envs.shell import shell_environment
    from localrl.envs.world import world_environment
    from localrl.training.settings import build_config

    assert environments.get("world:tiny-shell-world") is environments.get("world:http://host/v1|m") is world_environment
    assert environments.argument("world:http://host/v1|m") == "http://host/v1|m"
    assert build_config(None, {"env": "world:tiny-shell-world"}).model == "tiny-shell"  # the plug-in's preset
    # a package.module:function whose module is no registered name is still one
    assert environments.argument("localrl.envs.shell:shell_environment") == ""
    assert environments.get("localrl.envs.shell:shell_environment") is shell_environment
    with pytest.raises(UserError, match=r"^config field env: environment 'world' needs its SOURCE: world:SOURCE$"):
        environments.get("world")


def test_the_loop_names_no_objective_sampler_or_environment():
    """The loop (training/loop.py) asks the registries; a recipe's name anywhere in it (code, strings or comments) means a branch
    for that recipe crept back into the loop."""
    source = (ROOT / "localrl" / "training" / "loop.py").read_text().lower()
    names = set(objectives.names()) | set(samplers.names()) | set(environments.names())
    names |= {"markovian", "experience", "episode", "shell", "sft", "grpo", "library", "llama", "sandbox"}
    names -= {"world"}  # the simulated shell's name is also torch.distributed's word for the processes, which it names
    names |= {"simulat", "world_model", "world:"}
    found = sorted(n for n in names if re.search(rf"\b{re.escape(n)}", source))
    assert not found, f"localrl/training/loop.py names {found}"


@pytest.mark.parametrize("kind", ["objective", "sampler", "environment"])
def test_every_builtin_plugin_is_registered_by_the_module_that_defines_it(kind):
    registry = {"objective": objectives, "sampler": samplers, "environment": environments}[kind]
    builtin = {name: plugin for name, plugin in registry.items() if plugin.__module__.startswith("localrl.")}
    assert builtin, kind
    for name, plugin in builtin.items():
        assert plugin.__module__.startswith(registry.package + "."), (name, plugin.__module__)


EVAL_KINDS = {
    "grpo": dict(),  # (rollout auto: llama.cpp on a CPU where it is installed, and so in `localrl eval` too)
    "markovian": dict(markovian_chunk=16, markovian_carry=4),
    "agent": dict(model="tiny-shell", env="shell", max_turns=2, prompts_per_step=2, eval_size=6),
    "experience": dict(objective="experience", experience_judge_tokens=16),
    "prefix_tree": dict(sampler="prefix_tree", prompts_per_step=2),
    "plan_then_act": dict(sampler="plan_then_act", prompts_per_step=2, group_size=2, plan_count=2, plan_tokens=8),
    "preferences": dict(objective="dpo", sampler="preferences", loss_type="sigmoid", beta=0.1, prompts_per_step=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(EVAL_KINDS))
def test_localrl_eval_of_a_run_equals_the_runs_own_final_evaluation(builtin_model, tmp_path, kind):
    from localrl.commands.eval import evaluate_policy
    from localrl.training.loop import resume_config, train
    from tests.helpers import QUIET, make_tiny_model, small

    kw = dict(EVAL_KINDS[kind])
    if kind == "experience":
        kw["experience_judge"] = str(make_tiny_model(tmp_path / "judge", "llama", context=2048))
    result = train(small(tmp_path / "run", **{"steps": 2, "eval_size": 12, **kw}), **QUIET)
    of_run = evaluate_policy(resume_config(result.run_dir, {}), result.run_dir, samples=0)
    own = {k: v for k, v in result.eval_after.items() if k not in ("kind", "when", "step")}
    assert own["n"] > 0 and {k: v for k, v in of_run.items() if k != "model"} == own


@pytest.mark.slow
def test_plugins_named_as_module_function_run_from_a_fresh_process(builtin_model, tmp_path):
    """As a user names their own code: ``--objective pkg.module:Class`` (its settings' flags included) and ``--env
    pkg.module:function`` (here this test module, importable from the repository root), in a new ``localrl``
    process."""
    from tests.helpers import localrl

    from localrl.metrics import read_metrics
    from localrl.runs import Run

    # (an objective with settings of its own: its flag is known once the module is named)
    proc = localrl("train", "--objective", "tests.test_plugins:Rows", "--answer-rows", "2", "--steps", "2",
                   "--eval-size", "0", "--rollout", "torch", "--run-dir", tmp_path / "obj", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert [r["rows"] for r in read_metrics(Run(tmp_path / "obj").metrics_path) if r["kind"] == "train"] == [2, 2]
    proc = localrl("train", "--env", "tests.test_plugins:letters_environment", "--model", "tiny-shell", "--steps", "1",
                   "--prompts-per-step", "2", "--group-size", "2", "--max-turns", "1", "--max-new-tokens", "16",
                   "--eval-size", "2", "--run-dir", tmp_path / "env", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "held-out success" in proc.stdout
    proc = localrl("train", "--objective", "tests.test_plugins:nothing_here", "--run-dir", tmp_path / "bad", cwd=ROOT)
    assert proc.returncode == 2 and "objective 'tests.test_plugins:nothing_here': cannot import it" in proc.stderr
    assert not (tmp_path / "bad").exists()


# `localrl train --help`'s flags at the commit before the plug-in design (ae18837)
FLAGS_BEFORE = """
--4bit --beta --budget-schedule --budget-stages --calibration-weight --check-reward --config --data
--delta --device --dynamic-sampling --dynamic-sampling-rounds --entropy-coef --entropy-coef-delta
--entropy-coef-max --entropy-coef-min --entropy-target --env --env-families --env-levels --env-tasks
--env-timeout --env-workers --epsilon --epsilon-high --eval-batch-size --eval-data --eval-size
--experience-init --experience-judge --experience-judge-tokens --experience-size --format-weight
--group-size --hacking-window --help --importance-sampling-level --init-adapter --isolation
--keep-checkpoints --length-reward-weight --lora-alpha --lora-dropout --lora-rank --lora-targets
--loss-type --lr --markovian-carry --markovian-chunk --mask-truncated-completions --max-grad-norm
--max-new-tokens --max-new-tokens-final --max-turns --memory-budget --micro-batch-size --model --no-4bit
--no-dynamic-sampling --no-mask-truncated-completions --no-prompt-cache --no-reset-optimizer-on-sync
--no-sync-ref-model --no-unsloth --no-use-adaptive-entropy --no-use-bias-correction-kl --num-iterations
--objective --off-policy-mask-threshold --overlong-cache --prompt-cache --prompts-per-step --quantize
--ref-model-mixup-alpha --ref-model-sync-steps --reset-optimizer-on-sync --resume --reward
--reward-weights --rollout --rollout-is --rollout-is-cap --run-dir --sapo-temperature-neg
--sapo-temperature-pos --save-every --scale-rewards --seed --steps --sync-ref-model --system-prompt
--temperature --threads --top-entropy-quantile --unsloth --use-adaptive-entropy --use-bias-correction-kl
--vespo-k-neg --vespo-k-pos --vespo-lambda-neg --vespo-lambda-pos --weight-decay
""".split()


def test_every_flag_and_toml_key_from_before_the_plugin_design_still_works(tmp_path, capsys):
    """What users wrote before the loop was split into plug-ins still runs: every flag `localrl train --help`
    listed, and a TOML file of every field as that commit wrote it (``to_toml``), loads to the same config."""
    import re

    from localrl.cli import main
    from localrl.config import TrainConfig
    from localrl.config_io import flag_name, parse_overrides, read_toml
    from localrl.training.settings import build_config

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    now = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", capsys.readouterr().out))
    assert not set(FLAGS_BEFORE) - now, sorted(set(FLAGS_BEFORE) - now)
    assert build_config(ROOT / "tests" / "data" / "config-before-plugins.toml") == TrainConfig().validate()
    # and every field as it was before the plug-ins owned their settings (to_toml at 7f6db72): the same flag, TOML
    # key, type, default and help, wherever the field is declared now
    snapshot = ROOT / "tests" / "data" / "train-fields-2026-12-07.toml"
    assert build_config(snapshot) == TrainConfig().validate()
    before = read_toml(snapshot)
    assert len(before) == 126 and set(before) <= set(FIELDS)
    helps = dict(re.findall(r"^(\w+) = .*?  # (.*)$", snapshot.read_text(), re.M))
    for name, value in before.items():
        assert (type(FIELDS[name].default), FIELDS[name].default) == (type(value), value), name
        if name not in ("objective", "sampler", "env"):  # (these list the plug-ins now: -h lists the registries')
            assert FIELDS[name].metadata["help"] == helps[name], name
        assert parse_overrides([flag_name(name), str(value).lower() if isinstance(value, bool) else str(value)]) \
            == {name: value}


def test_the_python_api_still_imports_from_the_package():
    from localrl import TrainConfig, train

    assert callable(train) and TrainConfig().objective == "grpo"
