"""The package's shape: one import namespace, no import cycles, arrows pointing down, one owner of
the run directory's layout. Read from the source with ``ast``, imports inside functions included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder on disk -> the package it installs as (pyproject's package-dir)
FOLDERS = {"localrl": "localrl", "models": "localrl.models", "quant": "localrl.quant", "tui": "localrl.tui"}
RUN_FILE_NAMES = ("config.toml", "metrics.jsonl", "base.json", "trainer_state.pt", '"checkpoints"', "step-{")


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the localrl modules it imports when it runs (at the top or inside functions; not the annotations'
    ``if TYPE_CHECKING:`` imports)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # `if TYPE_CHECKING:` imports are for annotations: they never run
                continue
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:  # `from pkg import submodule` imports the submodule
                    targets.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_reader_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "localrl.runs" in graph["localrl.training.loop"] and "localrl.quant.gguf_writer" in graph["localrl.quant.export"]
    # objectives' package imports the config only for annotations (under TYPE_CHECKING): no runtime arrow
    assert "localrl.config" not in graph["localrl.objectives"]
    assert "localrl.objectives" in graph["localrl.training.settings"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


# The layers of the package, bottom to top; a module imports only from its own layer or the ones below.
LAYERS = [
    # the foundation: config, errors, the run directory, model loading, the planner, GGUF in and out
    ("localrl", "localrl.errors", "localrl.atomic", "localrl.registry", "localrl.config", "localrl.config_io",
     "localrl.runs",
     "localrl.metrics", "localrl.heap", "localrl.precision", "localrl.modeling", "localrl.memory",
     "localrl.distributed", "localrl.models", "localrl.models.shapes", "localrl.quant"),
    # building blocks: prompt data and rewards, token generation, the update's maths, environments and the
    # sandbox, the agent's protocol and session, held-out scoring and plots, experiment trackers
    ("localrl.data", "localrl.generation", "localrl.policy", "localrl.envs", "localrl.agent", "localrl.evaluation",
     "localrl.trackers"),
    ("localrl.samplers",),
    ("localrl.objectives",),  # objectives drive samplers
    ("localrl.training",),  # the loop drives objectives
    # what a user runs: the commands, benchmarks, serving, the baselines, building the built-in models
    ("localrl.commands", "localrl.benchmarks", "localrl.serving", "localrl.baselines", "localrl.models.build",
     "localrl.models.pretraining", "localrl.models.shell_pretraining", "localrl.models.world_pretraining"),
    ("localrl.tui",),  # the terminal UI (it runs training as a `localrl train` subprocess)
    ("localrl.cli", "localrl.__main__"),  # the command line: the one importer of the UI
]
# the arrows that point up, and why (none: the config is assembled with its plug-ins above their registries, in
# localrl.training.settings)
UPWARD: set[tuple[str, str]] = set()


def layer_of(module: str) -> int:
    """The layer of ``module``: that of the longest prefix named in LAYERS."""
    best, rank = "", None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, rank = name, i
    assert rank is not None, f"{module} is in no layer of tests/test_structure.py's LAYERS"
    return rank


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if layer_of(d) > layer_of(m) and (m, d) not in UPWARD)


def test_import_arrows_point_down():
    graph = import_graph()
    up = upward(graph)
    assert not up, "imports that point up a layer:\n" + "\n".join(up)
    # the config checks its own fields; the plug-ins' settings are checked above their registries
    plugins = {m for m in graph if m.startswith(PLUGIN_PACKAGES)}
    assert not graph["localrl.config"] & plugins, graph["localrl.config"] & plugins
    importers = lambda target: {m for m, deps in graph.items() if any(d == target or d.startswith(target + ".")
                                                                      for d in deps)}
    # the UI is on top: only the CLI starts it
    assert {m for m in importers("localrl.tui") if not m.startswith("localrl.tui")} == {"localrl.cli"}
    assert importers("localrl.cli") == {"localrl.__main__"}
    # built-in models do not pull in training code when imported
    assert graph["localrl.models"] == set()


def test_the_layer_rule_catches_an_upward_import():
    assert layer_of("localrl.policy.grpo") < layer_of("localrl.samplers.completions") < layer_of("localrl.training.loop")
    assert layer_of("localrl.models.build") > layer_of("localrl.models") == 0
    planted = {"localrl.policy.grpo": {"localrl.samplers.completions", "localrl.config"},
               "localrl.config": {"localrl.envs"}, "localrl.runs": {"localrl.data"}}
    assert upward(planted) == ["localrl.config -> localrl.envs", "localrl.policy.grpo -> localrl.samplers.completions",
                               "localrl.runs -> localrl.data"]


def test_every_package_is_installed():
    """A package folder missing from pyproject's list works in an editable install and is absent from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert packages == listed, (packages - listed, listed - packages)


PLUGIN_PACKAGES = ("localrl.objectives", "localrl.samplers", "localrl.envs")


def test_the_loop_reaches_plugins_only_through_their_registries():
    """The loop imports the plug-in packages' registries and protocols, never a plug-in module; no plug-in
    imports the loop, the CLI or the UI; a sampler never imports an objective (objectives drive samplers)."""
    graph = import_graph()
    plugin_modules = {m for m in graph if m.startswith(tuple(p + "." for p in PLUGIN_PACKAGES))}
    assert plugin_modules >= {"localrl.objectives.grpo", "localrl.samplers.completions", "localrl.envs.shell"}
    assert not graph["localrl.training.loop"] & plugin_modules, graph["localrl.training.loop"] & plugin_modules
    for m in plugin_modules | set(PLUGIN_PACKAGES):
        above = {d for d in graph[m] if d.startswith(("localrl.training.loop", "localrl.cli", "localrl.tui"))}
        assert not above, f"{m} imports {above}"
        if m.startswith("localrl.samplers"):
            assert not {d for d in graph[m] if d.startswith("localrl.objectives")}, m
    for package in PLUGIN_PACKAGES:  # the registries' own modules stay light: nothing of a plug-in's
        assert not graph[package] & plugin_modules, package


def test_run_directory_names_are_spelled_only_in_runs_py():
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path in modules().values() if path.name != "runs.py"
                 for name in RUN_FILE_NAMES if name in path.read_text()]
    assert not offenders


@pytest.mark.slow
def test_one_namespace_even_beside_a_users_own_models_package(tmp_path):
    """A project with its own models/ package: `python -m localrl` still finds the built-in models,
    and nothing generic (models, quant, tui) is importable from the installed package."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("ROOT = 'the user project'\n")
    listed = subprocess.run([sys.executable, "-m", "localrl", "models", "list"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("tiny-arith\t") and "\tbuilt" in listed.stdout
    for generic in ("quant", "tui"):
        probe = subprocess.run([sys.executable, "-c", f"import {generic}"], cwd=tmp_path, capture_output=True,
                               text=True)
        assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr
    ours = subprocess.run([sys.executable, "-c", "import models, localrl.models as m; print(models.ROOT, m.DEFAULT)"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert ours.stdout.split() == ["the", "user", "project", "tiny-arith"], ours.stderr


def test_builtin_names_match_their_pretraining():
    from localrl.models import builtin_names
    from localrl.models.build import PRETRAINING

    assert builtin_names() == sorted(PRETRAINING)


# Where a built-in plug-in's name is written outside the file that defines it, and why (a name elsewhere is a branch
# on a recipe, or a recipe choosing another by name, where a capability or a registry lookup belongs)
NAME_EXCEPTIONS = {
    ("localrl/config.py", "grpo"): "the default objective, and the default loss_type (policy/losses.py's grpo)",
    ("localrl/samplers/__init__.py", "completions"): "the default sampler, when no other claims a config",
    ("localrl/commands/train.py", "sft"): "`localrl sft` is the command that runs the sft objective",
    ("localrl/objectives/sft.py", "shell"): "its preset: the environment whose expert it learns from by default",
    ("localrl/commands/bench/world_model.py", "world"): "`localrl bench world`: a benchmark's name",
    ("localrl/commands/bench/approvals.py", "sft"): "`bench approvals --learn sft`: how that benchmark learns",
    ("localrl/evaluation/world_fidelity.py", "episodes"): "a column of its table (episodes played)",
    ("localrl/evaluation/analyze.py", "completions"): "a train record's count of completions",
    ("localrl/objectives/__init__.py", "completions"): "the train record's count of completions (step_record)",
}


def test_no_plugin_name_outside_its_own_file():
    """The loop, config.py, commands/, evaluation/, memory.py and the plug-in packages write no built-in plug-in's
    name (a quoted ``"name"`` or ``"name:..."``) outside the module that registers it, except NAME_EXCEPTIONS."""
    import inspect
    import re

    from localrl.envs import environments
    from localrl.objectives import objectives
    from localrl.samplers import samplers

    home = {name: Path(inspect.getsourcefile(plugin)).relative_to(ROOT).as_posix()
            for registry in (objectives, samplers, environments) for name, plugin in registry.items()
            if plugin.__module__.startswith("localrl.")}
    files = [ROOT / "localrl" / "training" / "loop.py", ROOT / "localrl" / "config.py", ROOT / "localrl" / "memory.py"]
    for folder in ("commands", "evaluation", "objectives", "samplers", "envs"):
        files += sorted((ROOT / "localrl" / folder).rglob("*.py"))
    found, used = [], set()
    for path in files:
        rel, source = path.relative_to(ROOT).as_posix(), path.read_text()
        for name, own in home.items():
            if rel == own or not re.search(rf"""(["']){re.escape(name)}(:[^"'\n]*)?\1""", source):
                continue
            if (rel, name) in NAME_EXCEPTIONS:
                used.add((rel, name))
            else:
                found.append(f"{rel}: {name!r}")
    assert not found, found
    assert used == set(NAME_EXCEPTIONS), set(NAME_EXCEPTIONS) - used  # an exception no longer needed goes


def test_no_big_file_or_function_but_those_the_architecture_doc_lists():
    """No module in localrl/ over 450 lines and no function over 80, except the rows of docs/architecture.md's
    "Big files and functions" table, each with its reason; a listed one that shrank leaves the table too."""
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc[doc.index("## Big files and functions"):doc.index("## Layout")]
    listed = set(re.findall(r"^\| `([^`]+)` \| \d+ \| \S", table, re.M))
    big = set()
    for path in sorted((ROOT / "localrl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        source = path.read_text()
        if len(source.splitlines()) > 450:
            big.add(rel)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                big.add(f"{rel}: {node.name}")
    assert big - listed == set(), f"over the size limits and not in docs/architecture.md: {sorted(big - listed)}"
    assert listed - big == set(), f"listed in docs/architecture.md, within the limits now: {sorted(listed - big)}"
