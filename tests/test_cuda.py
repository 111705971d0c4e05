"""The CUDA paths, checked whenever a GPU is present (marker ``cuda``; skipped on a CPU-only machine):
4-bit NF4 training, the memory planner against ``torch.cuda.max_memory_allocated``, and Unsloth.

    pytest -m cuda -v        # on a machine with an NVIDIA GPU
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_4bit_training_on_the_gpu_changes_the_adapter(builtin_model, tmp_path):
    from safetensors.torch import load_file

    from localrl.config import TrainConfig
    from localrl.runs import Run
    from localrl.training.loop import train

    cfg = TrainConfig(device="cuda", steps=3, prompts_per_step=8, group_size=8, eval_size=0,
                      run_dir=str(tmp_path / "run")).validate()
    records = []
    result = train(cfg, listeners=[records.append], log=lambda *_: None)
    status = next(r for r in records if r["kind"] == "status")
    assert "4-bit NF4 base (QLoRA)" in status["message"]  # quantize=auto on a GPU
    steps = [r for r in records if r["kind"] == "train"]
    assert len(steps) == 3 and all(r["peak_mem_mb"] > 0 for r in steps)
    adapter = load_file(str(Run(result.run_dir).latest_checkpoint() / "adapter_model.safetensors"))
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)


@pytest.mark.parametrize("prompt_len, completion_len, budget_mb", [(2000, 128, 2048), (4000, 64, 1024)])
def test_the_planner_predicts_the_gpu_peak(prompt_len, completion_len, budget_mb):
    """bf16 on CUDA: plan under a budget, run the step that way, compare with max_memory_allocated."""
    from localrl.benchmarks.harness import bench_model
    from localrl.memory import ModelShape, plan_step
    from tests.helpers import run_planned_step

    model = bench_model(torch.device("cuda"))
    shape = ModelShape.from_config(model.config)
    plan = plan_step(shape, 1, 8, prompt_len, completion_len, budget_mb * 2**20, dtype_bytes=2)
    assert plan.fits
    peak, predicted = run_planned_step(model, plan, prompt_len, completion_len)
    print(f"P={prompt_len} R={completion_len}: measured {peak / 2**20:.0f} MiB, "
          f"predicted {predicted / 2**20:.0f} MiB, plan {plan.describe().splitlines()[0]}")
    assert 0.75 <= peak / predicted <= 1.25, (peak, predicted, plan.describe())


def test_the_unsloth_path_trains_a_step(builtin_model, tmp_path):
    pytest.importorskip("unsloth", reason="the unsloth extra is not installed")
    from localrl.config import TrainConfig
    from localrl.training.loop import train

    cfg = TrainConfig(device="cuda", unsloth=True, steps=1, prompts_per_step=4, group_size=4, eval_size=0,
                      run_dir=str(tmp_path / "run")).validate()
    result = train(cfg, log=lambda *_: None)
    assert result.steps_done == 1


def test_a_qwen2_5_1_5b_shape_qlora_step_stays_under_8gb(tmp_path):
    """docs/memory.md's 1.5B step on a GPU: 4-bit NF4 base, LoRA rank 16, G=8, 256 + 256 tokens, an 8 GB budget."""
    import json

    from localrl.config import TrainConfig
    from localrl.models.shapes import write_shape
    from localrl.training.loop import train

    model = write_shape("qwen2.5-1.5b", tmp_path / "qwen", log=lambda *_: None)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": " ".join(["alpha bravo charlie delta"] * 64), "answer": "7"}) + "\n")
    cfg = TrainConfig(model=str(model), data=str(data), device="cuda", quantize="nf4", lora_rank=16, group_size=8,
                      prompts_per_step=1, max_new_tokens=256, memory_budget="8GB", steps=1, eval_size=0,
                      run_dir=str(tmp_path / "run")).validate()
    records = []
    train(cfg, listeners=[records.append], log=lambda *_: None)
    [step] = [r for r in records if r["kind"] == "train"]
    assert step["completion_len"] == 256 and step["peak_mem_mb"] < 8 * 1024, step
