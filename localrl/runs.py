"""The run directory: the one module that knows its layout.

    RUN_DIR/
      config.toml       the resolved TrainConfig, written once training can start (after a
                        resume's checkpoint has loaded, so a failed resume changes nothing)
      base.json         which base weights the run trains: name, path and a content fingerprint
      metrics.jsonl     the metrics sink's records (metrics.py): train, eval, checkpoint, status
      experience.json   objective experience (training-free GRPO): the experience library after the
                        latest step (experience.py); each checkpoint's trainer_state.pt holds its own
      checkpoints/
        step-000010/    a PEFT adapter directory plus trainer_state.pt (optimizer, RNG, step)

One live process owns a run directory: training (new or resumed) holds an exclusive lock on its ``.lock``
file from before anything in it is written or removed to the end, so a second ``train`` or ``--resume`` into a
live run is refused in one line naming the process, and the kernel lets the lock go however the owner ends.

Everything is written all or nothing: a checkpoint is written under ``.tmp-*`` and renamed
into place, an old one is renamed to ``.old-*`` before it is removed, so a kill at any moment
leaves only complete checkpoints under ``step-*`` names; leftovers go on the next start.

A run killed before its config was written (while its model loaded, say) can be started
again in the same directory; resuming it says so. Resume refuses what would be silently
wrong: other base weights than the run's own, or checkpoints that the metrics say were
saved but are gone. A damaged newest checkpoint falls back to the one before, with a line.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import shutil
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from localrl.atomic import atomic_dir, write_text_atomic
from localrl.config import FIELDS, TrainConfig
from localrl.config_io import coerce, config_values, read_toml, to_toml
from localrl.errors import UserError, first_line, out_of_space
from localrl.metrics import read_metrics

CONFIG = "config.toml"
BASE = "base.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"
ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's name for the adapter weights
ADAPTER_CONFIG = "adapter_config.json"  # and for its LoRA settings
EXPERIENCE = "experience.json"
LEARNING_CURVE = "learning_curve.png"  # `localrl plot`'s default, and what --report-to logs at the end
TENSORBOARD = "tensorboard"  # --report-to tensorboard's event files
WANDB = "wandb"  # --report-to wandb's offline runs
MLFLOW_STORE = "mlflow.db"  # --report-to mlflow's SQLite store
MLFLOW_ARTIFACTS = "mlflow-artifacts"  # and its artifacts
# the settings that define the adapter (its tensors' shapes, its scale): a resumed run keeps them
ADAPTER_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")
LOCK = ".lock"  # held (flock) by the process that trains in the directory; it holds that process's pid
_STEP_DIR = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^\.(tmp|old)-")


class Run:
    """A run directory. ``Run.create`` makes a new one; ``Run.open`` an existing one."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._made: Path | None = None  # the outermost directory ``create`` made (removed by ``discard``)
        self._lock = None  # the open lock file while this process owns the directory

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS

    @property
    def experience_path(self) -> Path:
        return self.path / EXPERIENCE

    @property
    def learning_curve_path(self) -> Path:
        return self.path / LEARNING_CURVE

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / TENSORBOARD

    @property
    def wandb_dir(self) -> Path:
        return self.path / WANDB

    @property
    def mlflow_store(self) -> Path:
        return self.path / MLFLOW_STORE

    @property
    def mlflow_artifacts_dir(self) -> Path:
        return self.path / MLFLOW_ARTIFACTS

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS

    # -- creating and opening -------------------------------------------------------------

    @classmethod
    def create(cls, path: str | Path | None = None, log: Callable[[str], None] = print) -> "Run":
        """The directory of a new run (default runs/<date>-<time>), made now, so that a place that
        cannot be written fails in one line before any weights load."""
        p = Path(path) if path else Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}"
        where = f"run_dir {p}"
        if p.exists() and not p.is_dir():
            raise UserError(f"{where}: is a file, not a directory", field="run_dir")
        if (p / CONFIG).exists():
            raise UserError(f"{where}: already exists; continue it with --resume {p}", field="run_dir")
        run = cls(p)
        if run._has_contents() and not run._never_started():
            raise UserError(f"{where}: not empty and not a run; choose another directory", field="run_dir")
        made = [a for a in [p, *p.parents] if not a.exists()]  # innermost first
        try:
            p.mkdir(parents=True, exist_ok=True)
            probe = p / f".tmp-probe-{uuid.uuid4().hex[:8]}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            if made:
                shutil.rmtree(made[-1], ignore_errors=True)
            raise UserError(f"{where}: cannot be written ({e.strerror or e})", field="run_dir") from None
        run.acquire()  # before anything here is removed: a run that is loading is not one that stopped
        if (p / CONFIG).exists():  # (written meanwhile by a run that has ended since)
            run.release()
            raise UserError(f"{where}: already exists; continue it with --resume {p}", field="run_dir")
        if run._has_contents():
            log(f"{p}: a run that stopped before it started left files here; starting it again")
            run.discard_contents()
        run._made = made[-1] if made else None
        return run

    def acquire(self) -> None:
        """Make this process the directory's one owner until ``release`` or its end (an exclusive ``flock``, which
        the kernel lets go when the process ends, however), or a UserError naming the process that owns it."""
        try:
            lock = open(self.path / LOCK, "a+")
        except OSError as e:
            raise UserError(f"run_dir {self.path}: cannot be written ({e.strerror or e})", field="run_dir") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.seek(0)
            owner = lock.read().strip()
            lock.close()
            who = f"localrl process {owner}" if owner.isdigit() else "another localrl process"
            raise UserError(f"run_dir {self.path}: in use by {who}, which is training in it; wait for it to end "
                            "or choose another directory", field="run_dir") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock = lock

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _has_contents(self) -> bool:
        return self.path.is_dir() and any(child.name != LOCK for child in self.path.iterdir())

    @classmethod
    def open(cls, path: str | Path, what: str = "run") -> "Run":
        """An existing run; one line naming the problem otherwise."""
        p = Path(path)
        if not p.exists():
            raise UserError(f"{what} {p}: no such directory")
        if not p.is_dir():
            raise UserError(f"{what} {p}: not a run directory (a file)")
        run = cls(p)
        if not run.config_path.is_file():
            if any(p.iterdir()) and run._never_started():
                raise UserError(f"{what} {p}: the run stopped before it started (no config.toml was written); "
                                f"start it again with: localrl train --run-dir {p}")
            raise UserError(f"{what} {p}: not a run directory (no config.toml)")
        return run

    def _never_started(self) -> bool:
        """Whether the directory holds only what a run leaves before its config is written:
        status records, an empty checkpoints folder, temporary files."""
        for child in self.path.iterdir():
            if _LEFTOVER.match(child.name) or child.name == LOCK:
                continue
            if child.name == CHECKPOINTS and child.is_dir():
                if any(not _LEFTOVER.match(c.name) for c in child.iterdir()):
                    return False
            elif child.name == METRICS and child.is_file():
                if any(r.get("kind") != "status" for r in read_metrics(child)):
                    return False
            else:
                return False
        return True

    def discard_contents(self) -> None:
        """Remove what a run that never started left (never called on a started run); not the lock."""
        for child in self.path.iterdir():
            if child.name == LOCK:
                continue
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)

    def discard(self) -> None:
        """Undo ``create`` for a run that did not start: remove what it made, leave what was there."""
        if self.config_path.exists():
            return
        if self._made is not None:
            shutil.rmtree(self._made, ignore_errors=True)
        elif self.path.is_dir():
            self.discard_contents()

    # -- config and base weights ----------------------------------------------------------

    def read_config(self, overrides: dict | None = None) -> TrainConfig:
        """The saved config with ``overrides`` applied (for example more steps); not written back. The file holds
        every field as the run resolved it (presets applied), so it is read as it is; the config's own fields are
        checked here, the plug-ins' settings by the run that uses it (``training.settings.check_config``), whose
        import registers them (``saved`` reads one field without them)."""
        saved = TrainConfig(**config_values(self.config_path, None))
        cfg = TrainConfig(**config_values(self.config_path, overrides)).validate()
        for name in ADAPTER_FIELDS:  # the checkpoints' tensors have these shapes: no checkpoint would load
            if getattr(cfg, name) != getattr(saved, name):
                raise UserError(f"config field {name}: the run's adapter was trained with {name} "
                                f"{getattr(saved, name)!r}; a resumed run keeps it (got {getattr(cfg, name)!r}); start "
                                f"a new run to change it", field=name)
        cfg.run_dir = str(self.path)
        return cfg

    def saved(self, name: str) -> Any:
        """One core field of the saved config (its default where the file does not set it), read without the
        plug-ins' settings registered."""
        return coerce(name, read_toml(self.config_path).get(name, FIELDS[name].default), f"{self.config_path}: ")

    def total_steps(self) -> int:
        """The configured number of steps; 0 while the config is missing or unreadable."""
        try:
            steps = self.saved("steps")
        except UserError:
            return 0
        return steps if steps >= 1 else 0

    def write_config(self, cfg: TrainConfig, base_fingerprint: dict | None = None) -> None:
        write_text_atomic(self.config_path, to_toml(cfg))
        if base_fingerprint is not None:
            write_text_atomic(self.path / BASE, json.dumps(base_fingerprint, indent=1) + "\n")

    def check_base(self, fingerprint: dict, what: str = "resume") -> None:
        """Stop a resume (or another use of the run's adapter, ``what``) whose base weights are not the ones
        the run was trained on."""
        path = self.path / BASE
        if not path.exists():
            return  # runs from before fingerprints; the next config write records one
        try:
            saved = json.loads(path.read_text())
            if not isinstance(saved, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise UserError(f"{what} {self.path}: {path.name} is damaged ({e}), so the base weights cannot be checked; "
                            f"restore it, or delete it to resume without the check") from None
        if saved.get("fingerprint") and fingerprint.get("fingerprint") and \
                saved["fingerprint"] != fingerprint["fingerprint"]:
            raise UserError(f"{what} {self.path}: model {fingerprint['model']} is not the base this run was trained "
                            f"on ({saved.get('model')}, {saved.get('path')}): its weights differ", field="model")

    # -- checkpoints ----------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Checkpoints under their final names, oldest first."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = [p for p in self.checkpoints_dir.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
        return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def latest_checkpoint(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def steps_done(self) -> int:
        """Steps saved in the newest checkpoint (0 without one)."""
        latest = self.latest_checkpoint()
        return int(_STEP_DIR.match(latest.name).group(1)) if latest else 0

    def remove_leftovers(self) -> None:
        """Delete what killed writes and deletions left: ``.tmp-*`` and ``.old-*`` entries."""
        for folder in (self.path, self.checkpoints_dir):
            if folder.is_dir():
                for stale in folder.iterdir():
                    if _LEFTOVER.match(stale.name):
                        _remove(stale)

    def save_checkpoint(self, step: int, model, optimizer, keep: int = 2, run_state: dict | None = None) -> Path:
        """Write checkpoint ``step`` (completed steps) atomically; keep the newest ``keep``. ``run_state``: what
        else the trainer carries from step to step (a synced KL reference, an adaptive coefficient)."""
        final = self.checkpoints_dir / f"step-{step:06d}"
        try:
            with atomic_dir(final, fsync=True) as tmp:
                model.save_pretrained(str(tmp))
                torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": _rng_state(),
                            "run_state": run_state or {}}, tmp / STATE_FILE)
        except Exception as e:  # noqa: BLE001 - a full disk is one line; anything else keeps its traceback
            if not out_of_space(e):
                raise
            last = self.latest_checkpoint()
            raise UserError(f"could not write checkpoint {final.name} in {self.checkpoints_dir} "
                            f"({first_line(e)}; {_free_space(self.path)}); the last good checkpoint is "
                            f"{last or 'none yet'}, and nothing half-written was left") from None
        for old in self.checkpoints()[:-keep]:
            # rename first: a kill mid-delete leaves a .old-* leftover, never a step-* without its files
            _remove(old)
        return final

    def restore(self, model, optimizer, log: Callable[[str], None] = print, run_state: dict | None = None) -> int:
        """Load the newest checkpoint that loads into ``model`` and ``optimizer``; the step it saved.

        ``run_state`` is updated with what the checkpoint saved of it.
        0 when the run has saved none yet. A damaged newest checkpoint falls back to an older
        one, with a line; a run whose metrics record a checkpoint that is gone is refused
        rather than silently restarted from step 0.
        """
        found = self.checkpoints()
        errors = []
        for ckpt in reversed(found):
            try:
                step = _load_checkpoint(ckpt, model, optimizer, run_state)
            except UserError as e:
                errors.append(str(e))
                log(f"{e}; trying the checkpoint before it")
                continue
            log(f"resumed {self.path} from {ckpt.name}" + (" (the newest that loads)" if errors else ""))
            return step
        if errors:
            raise UserError(f"resume {self.path}: no checkpoint loads ({errors[0]})")
        saved = [r["step"] for r in read_metrics(self.metrics_path) if r.get("kind") == "checkpoint"]
        if saved:
            raise UserError(f"resume {self.path}: its metrics record a checkpoint at step {max(saved)}, but "
                            f"{CHECKPOINTS}/ holds none; refusing to restart from step 0 (start a new run instead)")
        log(f"{self.path}: no checkpoint saved yet; starting from step 0")
        return 0

    # -- the trained policy ---------------------------------------------------------------

    def load_adapter(self, device: torch.device, in_4bit: bool, cfg: TrainConfig | None = None):
        """(base + the newest checkpoint's adapter, tokenizer, checkpoint): the run's policy."""
        from peft import PeftModel

        from localrl.modeling import load_base, load_config, load_tokenizer

        model, dtype = (cfg.model, cfg.compute_dtype) if cfg else (self.saved("model"), self.saved("compute_dtype"))
        ckpt = self._require_checkpoint()
        path, _ = load_config(model)
        tok = load_tokenizer(path)
        base = load_base(path, in_4bit, device, dtype)
        try:
            model = PeftModel.from_pretrained(base, str(ckpt))
        except Exception as e:  # a damaged adapter: one line, not a traceback
            raise UserError(f"run {self.path}: adapter {ckpt.name} cannot be loaded ({first_line(e)})") from None
        return model, tok, ckpt

    def load_merged(self, check: Callable | None = None):
        """(adapter merged onto the full-precision base, tokenizer, tokenizer dir, description);
        ``check(config, tok)`` runs before any weights load."""
        from peft import PeftModel

        from localrl.modeling import load_config, load_full, load_tokenizer

        ckpt = self._require_checkpoint()
        path, config = load_config(self.saved("model"))
        tok = load_tokenizer(path)
        if check is not None:
            check(config, tok)
        base = load_full(path)
        try:
            model = PeftModel.from_pretrained(base, str(ckpt)).merge_and_unload()
        except Exception as e:
            raise UserError(f"run {self.path}: adapter {ckpt.name} cannot be loaded ({first_line(e)})") from None
        return model.eval(), tok, Path(path), f"adapter {ckpt} merged onto the full-precision (float32) base {path}"

    def _require_checkpoint(self) -> Path:
        ckpt = self.latest_checkpoint()
        if ckpt is None:
            raise UserError(f"run {self.path}: has no checkpoint yet")
        return ckpt


def is_run(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def newest_run(runs_dir: str | Path) -> Path | None:
    """The run under ``runs_dir`` with the newest checkpoint (one a chat or export can load), or None."""
    best: tuple[float, Path] | None = None
    for path in Path(runs_dir).iterdir() if Path(runs_dir).is_dir() else ():
        ckpt = Run(path).latest_checkpoint() if is_run(path) else None
        if ckpt is not None and (best is None or ckpt.stat().st_mtime > best[0]):
            best = (ckpt.stat().st_mtime, path)
    return best[1] if best else None


def load_merged(source: str | Path, check: Callable | None = None):
    """A run's policy (its adapter merged onto the full-precision base) or a model's own weights:
    (model, tokenizer, tokenizer dir, description). ``check(config, tok)`` runs before weights load."""
    from localrl.modeling import load_config, load_full, load_tokenizer

    if is_run(source):
        return Run(source).load_merged(check)
    path, config = load_config(str(source))
    tok = load_tokenizer(path)
    if check is not None:
        check(config, tok)
    return load_full(path).eval(), tok, Path(path), f"full-precision (float32) weights of {path}"


def adapter_source(cfg: TrainConfig, fingerprint: dict) -> Path:
    """The adapter directory that ``cfg.init_adapter`` names: a run's newest checkpoint (a run of other base
    weights than ``fingerprint``'s is refused) or a PEFT adapter directory, with this run's LoRA rank and alpha."""
    p = Path(cfg.init_adapter)
    where = f"config field init_adapter: {p}"
    if not p.is_dir():
        raise UserError(f"{where}: no such directory", field="init_adapter")
    if is_run(p):
        run = Run(p)
        run.check_base(fingerprint, "init_adapter")
        source = run.latest_checkpoint()
        if source is None:
            raise UserError(f"{where}: the run has no checkpoint yet", field="init_adapter")
    elif (p / ADAPTER_FILE).is_file():
        source = p
    else:
        raise UserError(f"{where}: neither a run directory nor a PEFT adapter directory (no {ADAPTER_FILE})",
                        field="init_adapter")
    try:
        saved = json.loads((source / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError):
        saved = {}
    r, alpha = saved.get("r"), saved.get("lora_alpha")
    if (r is not None and r != cfg.lora_rank) or (alpha is not None and alpha != cfg.lora_alpha):
        raise UserError(f"{where}: its adapter has LoRA rank {r} and alpha {alpha}, this run {cfg.lora_rank} and "
                        f"{cfg.lora_alpha} (set --lora-rank {r} --lora-alpha {alpha})", field="init_adapter")
    return source


def load_adapter_weights(model, source: Path) -> None:
    """Set ``model``'s LoRA weights to those of the adapter directory ``source`` (``adapter_source``)."""
    from safetensors.torch import load_file

    try:
        _set_adapter(model, load_file(str(source / ADAPTER_FILE)))
    except Exception as e:
        raise UserError(f"config field init_adapter: {source}: does not fit this model's adapter ({first_line(e)}; "
                        f"were its lora_targets the same?)", field="init_adapter") from None


def _set_adapter(model, weights: dict, name: str = "default") -> None:
    """Set the LoRA weights of ``model``'s adapter ``name`` (PEFT's; the run's own is "default") to ``weights``."""
    from peft import set_peft_model_state_dict

    expected = {k for k in model.state_dict() if "lora_" in k and f".{name}." in k}
    if not weights or len(weights) != len(expected):
        raise ValueError(f"{len(weights)} adapter tensors, the model's adapter {name} has {len(expected)}")
    result = set_peft_model_state_dict(model, weights, adapter_name=name)
    if result.unexpected_keys:
        raise ValueError(f"unexpected adapter keys {result.unexpected_keys[:3]}")


def base_fingerprint(model: str) -> dict:
    """What base.json records: the model's name, where it resolved, and a fingerprint of its weights."""
    from localrl.modeling import resolve_model, weights_fingerprint

    path = resolve_model(model)
    return {"model": model, "path": path, "fingerprint": weights_fingerprint(path)}


# -- one checkpoint's contents -------------------------------------------------------------


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _load_checkpoint(ckpt: Path, model, optimizer, run_state: dict | None = None) -> int:
    """Restore adapter weights, optimizer and RNG state from ``ckpt``; returns its step. Every file
    is read before anything is changed, so a damaged checkpoint leaves model and optimizer as they were."""
    from peft import PeftConfig
    from safetensors.torch import load_file

    try:
        # every adapter the model has (self-play's second one too), saved as PEFT saves them: the run's own at the
        # top, any other in a folder of its name; its config read as `eval` and `export` will read it
        folders = {name: ckpt if name == "default" else ckpt / name
                   for name in getattr(model, "peft_config", None) or ["default"]}
        for folder in folders.values():
            PeftConfig.from_pretrained(str(folder))
        adapters = {name: load_file(str(folder / ADAPTER_FILE)) for name, folder in folders.items()}
        state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
        for name, weights in adapters.items():
            _set_adapter(model, weights, name)
        optimizer.load_state_dict(state["optimizer"])
    except Exception as e:  # a damaged file must stop resume with one line, not a traceback
        raise UserError(f"checkpoint {ckpt}: cannot be loaded ({first_line(e)})") from None
    if run_state is not None:
        run_state.update(state.get("run_state", {}))
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    return int(state["step"])


def _remove(path: Path) -> None:
    """Delete by rename-then-remove, so a kill midway leaves a hidden leftover, not a damaged entry."""
    target = path
    if not _LEFTOVER.match(path.name):
        target = path.with_name(f".old-{path.name}-{uuid.uuid4().hex[:8]}")
        path.rename(target)
    if target.is_dir():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)


def _free_space(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.1f} MB free there"
    except OSError:
        return "free space unknown"
