"""Samplers: where a step's scored rollouts come from, and how held-out problems are decoded.

A sampler is named by the config's ``sampler`` (Tree-OPO's prefix trees: ``prefix_tree``), or chosen by the
rest of it: each registered sampler says whether a config ``selects`` it (multi-turn episodes when ``env`` is set,
Markovian traces when ``markovian_chunk`` is), prompt completions are the default, and two samplers claiming one
config is an error that asks for ``sampler`` to name one (never a pick by module order). The run's own evaluations,
``localrl eval``, the terminal UI and the benchmarks all evaluate through the sampler's ``evaluate``, so one
checkpoint gives one figure.

    sampler = sampler_for(cfg)                    # the class; sampler_for(cfg)(cfg, rewards) the instance
    plan = sampler.prepare(info)                  # before weights load: data, prompts against the context
    sampler.start(model, tok, budget)             # after the model loaded (e.g. llama.cpp's copy)
    batch = sampler.sample(ctx, step, tokens, system)    # a step's scored rollouts (``Batch``)
    sampler.evaluate(model, tok, progress, batch_size, system, stops=stops)  # held-out figures
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from localrl.errors import UserError
from localrl.registry import Registry

if TYPE_CHECKING:
    from localrl.config import TrainConfig
    from localrl.data.rewards import RewardFn
    from localrl.distributed import World
    from localrl.generation.rollout import Rollout

samplers = Registry("sampler", "sampler", "localrl.samplers")
DEFAULT = "completions"


@dataclass
class ModelInfo:
    """What preflight knows of the model without its weights."""

    path: str  # its resolved directory
    config: Any  # transformers' config
    tok: Any
    context: int | None  # max_position_embeddings (None: unknown)
    device: torch.device


@dataclass
class Plan:
    """What a sampler's preflight found: the memory planner's lengths and who decodes."""

    longest_prompt: int  # tokens, through the chat template
    completion_tokens: int  # the longest completion a step trains on (a trajectory, for episodes)
    backend: str = "torch"  # who samples: "torch" or "llama.cpp"
    why: str = ""  # the choice in words, for the run's first lines
    extra_bytes: int = 0  # memory held all run besides the policy (llama.cpp's copy and context)
    rows_per_prompt: int = 0  # rows a step trains per prompt, for the planner (0: group_size; a tree's: more)


@dataclass
class Batch:
    """A step's scored rollouts: what the update trains on and what the step's record reports."""

    rollout: Rollout  # the rows the update trains on
    rewards: torch.Tensor  # [completions sampled] float64, the rewards combined
    scores: list[list[float]]  # each reward's scores of every completion sampled (the first: correctness)
    names: list[str]  # the rewards' names
    lengths: list[int]  # tokens of every completion sampled
    truncated: float  # the share of completions cut off
    gen_s: float  # seconds spent sampling
    max_len: int  # the longest a trained row can be (dr_grpo's constant)
    train_rewards: torch.Tensor | None = None  # the rewards of the trained completions, when a subset is trained
    sampler_logp: torch.Tensor | None = None  # another sampler's log-probs (llama.cpp), for importance weights
    reward_rows: torch.Tensor | None = None  # each row's completion, where rows are not completions
    rows: list[dict] = field(default_factory=list)  # the prompts' data rows (single-turn)
    texts: list[str] = field(default_factory=list)  # the decoded completions (single-turn)
    extra: dict = field(default_factory=dict)  # the sampler's own fields of the step record
    advantages: torch.Tensor | None = None  # [rows] the sampler's own advantages, where its structure defines them
    # (a prefix tree's), instead of the objective's group-relative ones
    # an episode's turns (multi-turn samplers): each row's turns as [start, end) token spans of its completion,
    # and the environment's reward after each turn where it gives one
    turn_spans: list[list[tuple[int, int]]] | None = None
    turn_rewards: list[list[float]] | None = None


@dataclass(frozen=True)
class Measure:
    """How result lines name a sampler's held-out figure: what it is, the items counted, how they are decoded."""

    what: str = "accuracy"
    items: str = "problems"
    how: str = "greedy pass@1"


class Sampler(ABC):
    """The base of a sampler; ``prepare``, ``sample`` and ``evaluate`` are its substance (abstract)."""

    owns: tuple[str, ...] = ()  # config fields that mean something only when it is named (localrl.registry)
    # the objective capabilities it needs (``Objective.samples``, ``group_relative``, ``takes_pairs``), each with why
    needs: dict[str, str] = {}
    # the dataset types of a data source it reads (``localrl.data.dataset_types``: TRL's, told by the columns); a
    # source of a type only another sampler reads selects that one, where the objective can train with it
    reads: tuple[str, ...] = ()
    measure = Measure()  # what its held-out evaluation's accuracy counts (result lines, ``localrl eval``)

    def __init__(self, cfg: TrainConfig, rewards: tuple[list[RewardFn], list[float]] | None = None):
        self.cfg = cfg

    @classmethod
    def selects(cls, cfg: TrainConfig) -> bool:
        """Whether ``cfg`` asks for this sampler (the default sampler is used when none does)."""
        return False

    @staticmethod
    def check_settings(cfg: TrainConfig) -> None:
        """Check its own config fields and the combinations it cannot run with, selected or not (``check_config``
        calls it; ``localrl.config.check_fields`` words the error)."""

    def check(self, world: World) -> None:
        """Refuse what it cannot run with in this launch (torchrun), in one line naming the field."""

    @abstractmethod
    def prepare(self, info: ModelInfo | None, reserve: int = 0) -> Plan:
        """Load and check the data before any weights load (``info`` None: for evaluation only, unchecked);
        ``reserve``: tokens the objective adds to every prompt (``Objective.prompt_tokens``), held free in the
        context and counted in the plan."""

    def start(self, model, tok, budget) -> None:
        """After the model loaded."""

    @property
    def held_out(self) -> list:
        """The held-out problems (empty: the run evaluates nothing)."""
        return []

    @property
    def check_name(self) -> str | None:
        """The reward the hacking monitor reads from each record's ``rewards`` (None: no monitor)."""
        return None

    @abstractmethod
    def sample(self, ctx, step: int, tokens: int, system: Callable[[str | None], str | None]) -> Batch:
        """A step's scored rollouts (0-based ``step``; ``tokens``: its completion budget; ``system``: the
        objective's system message for a task's own)."""

    @abstractmethod
    def evaluate(self, model, tok, progress=None, batch_size: int = 64,
                 system: Callable[[str | None], str | None] = lambda s: s, samples: int = 0,
                 stops: list[int] | None = None) -> dict:
        """Held-out figures of ``model`` (``samples``: how many decoded examples to keep; ``stops``: the token
        ids that end a completion, the run's own when a run evaluates)."""

    def after_step(self, record: dict) -> None:
        """The record pooled over ranks: may add to it."""

    def describe_eval(self) -> str:
        """What ``localrl eval`` evaluates on, in words."""
        return ""

    @staticmethod
    def eval_line(r: dict) -> str:
        """One of its held-out evaluation records in one line (the progress display, ``localrl eval``)."""
        line = f"accuracy {r['accuracy']:.1%}, mean reward {r['reward_mean']:.3f} ({r['n']} held-out, greedy)"
        if "ece" in r:
            line += (f"; calibration: ECE {r['ece']:.3f}, Brier {r['brier']:.3f}, mean confidence "
                     f"{r['confidence_mean']:.2f} ({r['confidence_stated']:.0%} stated one)")
        return line

    def require_held_out(self) -> None:
        """Refuse, in one line, to evaluate where there is nothing held out."""
        if not self.held_out:
            raise UserError(f"config field eval_size: no held-out problems to evaluate on (eval_size is "
                            f"{self.cfg.eval_size})", field="eval_size")

    def close(self) -> None:
        """Release what ``start`` made."""


def sampler_for(cfg: TrainConfig) -> type[Sampler]:
    """The sampler class ``cfg`` names (``sampler``), else the one registered sampler whose ``selects`` claims
    ``cfg`` (the default, prompt completions, when none does); two that claim it are one line asking to name one."""
    if cfg.sampler:
        return samplers.get(cfg.sampler)
    claims = sorted(name for name, s in samplers.items() if name != DEFAULT and s.selects(cfg))
    if len(claims) > 1:
        raise UserError(f"config field sampler: samplers {', '.join(claims)} each claim this config; name one "
                        f"(--sampler NAME)", field="sampler")
    return samplers.get(claims[0] if claims else DEFAULT)


def _selected(cfg: TrainConfig) -> str:
    """The name of the sampler ``cfg`` selects, named or picked (``sampler_for``): the owner of the fields that
    mean something in this run (``localrl.registry``)."""
    if cfg.sampler:
        return cfg.sampler
    chosen = sampler_for(cfg)
    return next(name for name, s in samplers.items() if s is chosen)


samplers.selected = _selected
