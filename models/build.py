"""Every built-in model's pretraining, by name: ``localrl models build NAME`` runs it."""

from __future__ import annotations

from pathlib import Path

from localrl.models.pretraining import Pretraining, arith_data, pretrain
from localrl.models.shell_pretraining import ShellPretraining, shell_data
from localrl.models.world_pretraining import WorldPretraining, world_data

PRETRAINING: dict[str, Pretraining] = {
    "tiny-arith": Pretraining(),
    "tiny-arith-conf": Pretraining(confidence=True),
    "tiny-arith-verbose": Pretraining(restate=0.5),
    "tiny-shell": ShellPretraining(steps=5000, batch_size=32, max_positions=512, corpus_tasks=6000),
    "tiny-shell-world": WorldPretraining(steps=1500, batch_size=32, max_positions=640, corpus_tasks=2000),
}

DATA = {WorldPretraining: world_data, ShellPretraining: shell_data, Pretraining: arith_data}


FIDELITY_TASKS = 100  # held-out tasks a built world model's fidelity is measured on (fidelity.json beside it)


def build(out_dir: str | Path, spec: Pretraining, log=print) -> Path:
    """Pretrain ``spec`` into ``out_dir`` (atomically); a world model's fidelity is measured on held-out tasks and
    written beside it."""
    out = pretrain(out_dir, spec, DATA[type(spec)], log)
    if isinstance(spec, WorldPretraining):
        write_fidelity(Path(out), log)
    return out


def write_fidelity(model_dir: Path, log=print) -> dict:
    """The fidelity of the world model in ``model_dir`` on the held-out shell tasks, into its fidelity.json."""
    import json

    from localrl.atomic import write_text_atomic
    from localrl.envs.shell_tasks import held_out_tasks
    from localrl.envs.world_models import TorchWorld
    from localrl.evaluation.world_fidelity import fidelity, format_fidelity

    world = TorchWorld(str(model_dir))
    try:
        result = fidelity(world, held_out_tasks(FIDELITY_TASKS))
    finally:
        world.close()
    write_text_atomic(model_dir / "fidelity.json", json.dumps(result, indent=2) + "\n")
    log(f"fidelity on {FIDELITY_TASKS} held-out tasks (names never seen), against the real sandbox:\n"
        + format_fidelity(result))
    return result
