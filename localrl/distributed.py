"""Data-parallel training under ``torchrun``: ranks own whole prompt groups, one all-reduce of the LoRA gradients.

    torchrun --nproc-per-node 2 -m localrl train ...     (NCCL on GPUs, gloo on CPUs)

Each rank holds the whole model (a 4-bit base placed on its own GPU, ``cuda:LOCAL_RANK``) and
samples, scores and computes the loss of its own ``prompts_per_step`` prompts with their G
completions: a group never spans ranks, so group advantages and the shared-prompt forward stay
local. What crosses ranks per step is small: the rewards (so that batch-scaled advantages and
the step's statistics are of the global batch), the loss's normaliser (rows or tokens of the
global batch), one flat all-reduce (sum) of the LoRA gradients before clipping and the
optimizer step, and the metrics record. Every rank then applies the same update to the same
weights, so the adapters stay equal without a broadcast after the first.

The global batch is ``prompts_per_step x world size`` prompts; the prompts of a step are a pure
function of (seed, step) and each group's sampling generator of (seed, step, its index in the
global batch), so 2 ranks x B prompts take the same step as 1 process x 2B prompts, and a resumed
distributed run repeats an uninterrupted one. Rank 0 alone writes the run directory (config,
metrics, checkpoints) and runs the held-out evaluation; every rank loads a checkpoint on resume.

Without torchrun's environment (or with a world of one) nothing here does anything: ``World()``
is a single process and training takes exactly the path it takes without this module.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from localrl.errors import UserError

# the held-out evaluation runs on rank 0 while the others wait at a barrier: allow it time
COLLECTIVE_TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class World:
    """This process's place among the ranks of a torchrun launch (a single process by default)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def one_process(self, field: str, what: str) -> None:
        """Refuse this launch in one line naming the config ``field`` if it has more than one rank: ``what`` (a
        plug-in) runs in one process."""
        if self.distributed:
            raise UserError(f"config field {field}: {what} runs in one process; launch it without torchrun (this "
                            f"launch has {self.size} ranks)", field=field)

    def shard(self, n: int) -> slice:
        """This rank's ``n`` items of a global list of ``n x size`` (whole prompt groups)."""
        return slice(self.rank * n, (self.rank + 1) * n)

    # -- collectives (each one is the identity in a single process) -------------------------

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def sum(self, *values: float) -> tuple[float, ...]:
        """The sums over ranks of a few numbers, in one all-reduce."""
        if not self.distributed:
            return tuple(float(v) for v in values)
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        torch.distributed.all_reduce(t)
        return tuple(t.tolist())

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank."""
        return self.sum(float(flag))[0] > 0

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank (small picklable objects)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.size
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def rank_0_first(self, fn):
        """``fn()`` on rank 0, then on the other ranks: what rank 0 leaves behind (a GGUF converted once into the
        shared cache) the others find made. A problem rank 0 finds in its one line stops every rank with it."""
        if not self.distributed:
            return fn()
        result, problem = None, ("", None)
        if self.is_main:
            try:
                result = fn()
            except UserError as e:
                problem = (str(e), e.field)
        message, field = self.broadcast(problem)
        if message:
            error = UserError(message, field=field)
            error.shared = True  # every rank stops with it: the CLI lets rank 0 say it before any rank exits
            raise error
        return result if self.is_main else fn()

    def broadcast_parameters(self, params: list[torch.Tensor]) -> None:
        """Rank 0's values of ``params`` on every rank, in one flat broadcast."""
        if not self.distributed or not params:
            return
        flat = torch.cat([p.detach().reshape(-1).float() for p in params])
        torch.distributed.broadcast(flat, src=0)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def all_reduce_gradients(self, params: list[torch.Tensor]) -> float:
        """Sum the gradients of ``params`` over ranks, in place, as one flat buffer (a rank that computed
        nothing this step contributes zeros); returns the seconds it took."""
        if not self.distributed or not params:
            return 0.0
        t0 = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
        return time.perf_counter() - t0

    def _device(self) -> torch.device:
        if torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


_world = World()


def world() -> World:
    """This process's World (``init_from_env`` sets it up under torchrun)."""
    return _world


def init_from_env(environ=os.environ) -> World:
    """Join the process group that torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT) describes: NCCL when CUDA is present, gloo otherwise. Without it, or with a world of one,
    the single-process World. Called once per process; later calls return the same World."""
    global _world
    if _world.distributed or "WORLD_SIZE" not in environ:
        return _world
    size = int(environ["WORLD_SIZE"])
    if size == 1:
        return _world
    rank, local_rank = int(environ["RANK"]), int(environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
    _world = World(rank, size, local_rank)
    return _world


def shutdown() -> None:
    """Leave the process group (at the end of a distributed run)."""
    global _world
    if _world.distributed and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _world = World()


def rank_device(device: torch.device, w: World) -> torch.device:
    """The device of this rank: its own GPU (``cuda:LOCAL_RANK``) when training on CUDA."""
    if device.type == "cuda" and w.distributed:
        return torch.device("cuda", w.local_rank)
    return device


# How each field of a step's metrics record combines over ranks. Fields not named here are equal on
# every rank (the update's statistics, reduced inside it; lr; step) and are taken from rank 0.
_WEIGHTED_MEANS = ("reward_mean", "accuracy", "completion_len", "truncated", "turns", "tool_calls",
                   "invalid_calls", "answered", "model_tokens")
_SUMS = ("tokens_per_s", "completions", "sampled_prompts", "sandbox_s")
_MAXIMA = ("gen_s", "step_s", "peak_mem_mb", "env_s", "model_s", "rollout_s")
# a rank's all-reduce time includes its wait for the slowest rank; the last to arrive measures the transfer
_MINIMA = ("allreduce_s",)


def pool_records(records: list[dict]) -> dict:
    """One metrics record of a distributed step from the ranks' records (``completions`` each): means
    weighted by completions, the pooled standard deviation of the rewards, sums of throughputs and counts,
    the slowest rank's times."""
    first = dict(records[0])
    if len(records) == 1:
        return first
    n = [r["completions"] for r in records]
    total = sum(n)

    def mean(key: str, rs=records) -> float:
        return sum(r[key] * k for r, k in zip(rs, n)) / total

    for key in _WEIGHTED_MEANS:
        if key in first and isinstance(first[key], (int, float)):
            first[key] = mean(key)
    for key in _SUMS:
        if key in first:
            first[key] = sum(r[key] for r in records)
    for key in _MAXIMA:
        if key in first and first[key] is not None:
            first[key] = max(r[key] for r in records)
    for key in _MINIMA:
        if key in first:
            first[key] = min(r[key] for r in records)
    if "rewards" in first:
        first["rewards"] = {name: sum(r["rewards"][name] * k for r, k in zip(records, n)) / total
                            for name in first["rewards"]}
    if "reward_std" in first:  # pooled: within-rank variance plus the spread of the rank means
        m = first["reward_mean"]
        squares = sum((k - 1) * r["reward_std"] ** 2 + k * (r["reward_mean"] - m) ** 2 for r, k in zip(records, n))
        first["reward_std"] = (squares / max(total - 1, 1)) ** 0.5
    return first
