"""The run configuration: one dataclass of flat fields (``--loss-type dapo``, ``loss_type = "dapo"``, as TRL's
configs are), the core's here and each plug-in's from its own settings dataclass (``add_settings``, called as a
plug-in registers: ``localrl.registry``).

The core fields are grouped by what they set: what to train, the adapter and objective, the step, sampling, the
loss, the KL, the optimiser, agent training, the run. ``validate()`` checks them; a plug-in checks its own and owns
its preset, and the config is assembled with them above the registries, by ``localrl.training.settings``
(``build_config``, ``check_config``): this module imports no plug-in. How a config is written (flags, TOML, the
``-h`` listing) is ``localrl.config_io``.

Precedence: field defaults < the selected environment's preset (with ``env``) < the selected objective's (with
``objective``) < ``--config FILE.toml`` < command-line flags. Every field has a default and a one-line help
(the ``help`` metadata, also shown by ``localrl train -h``); the checks reject impossible settings before any
model is loaded. Every error is a ``UserError`` that carries the field's name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from localrl.errors import UserError

BUILTIN_TASKS = ("arith", "words", "drafts")
SCALE_REWARDS = ("group", "batch", "none")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's importance sampling modes


def setting(default: Any, help: str) -> Any:
    """A config field: its default and its one-line help (``localrl train -h``, the TOML file's comment). The core
    fields below are made with it, and so is each plug-in's settings dataclass (``add_settings``)."""
    return field(default=default, metadata={"help": help})


_f = setting  # (spelt short in the core fields' table below)


@dataclass
class TrainConfig:
    # what to train: the model, the data, the rewards
    model: str = _f("tiny-arith", "built-in model name, local Hugging Face model directory, FILE.gguf, "
                                  "ollama:NAME[:TAG], or hub id")
    data: str = _f("arith", "built-in task ('arith': addition, 'words': word problems, 'drafts': fix an addition's "
                            "flawed worked answer), a JSONL, Parquet, CSV, JSON "
                            "or Arrow file of {prompt, answer, ...} rows, a datasets save_to_disk directory, or a "
                            "hub id already in the local datasets cache (read offline)")
    eval_data: str = _f("", "held-out rows, from any source data reads; empty: the task's own held-out split (or "
                            "eval_split of data)")
    data_config: str = _f("", "the dataset's config (datasets' `name`, e.g. main for openai/gsm8k); empty: its default")
    data_split: str = _f("train", "the split of a dataset (hub id or save_to_disk directory) to train on")
    eval_split: str = _f("", "held-out rows from this split of data (or of eval_data), e.g. test; empty: a seeded "
                             "tenth of the training rows, at most eval_size")
    prompt_column: str = _f("prompt", "the column holding each prompt (a string or a list of {role, content} "
                                      "messages)")
    answer_column: str = _f("answer", "the column holding each reference answer")
    answer_format: str = _f("", "how the answer column is read: empty (as it is), gsm8k (what follows ####), "
                                "last-number, or regex:PATTERN (its first group)")
    reward: str = _f("numeric", "rewards, comma-separated, each numeric, exact, regex, format, draft_edits, "
                                "judge:URL|MODEL (an "
                                "LLM judge behind an OpenAI-compatible endpoint) or package.module:function; the "
                                "first is the correctness reward that accuracy counts")
    reward_weights: str = _f("", "comma-separated weight of each reward in `reward` (empty: 1 each)")
    judge_concurrency: int = _f(4, "judges behind an HTTP endpoint (reward judge:URL|MODEL, experience_judge): "
                                   "requests in flight at once")
    judge_timeout: float = _f(120.0, "judges behind an HTTP endpoint: seconds a request may take")
    judge_retries: int = _f(2, "judges behind an HTTP endpoint: retries of a request that failed to connect, timed "
                               "out or got a 429 or 5xx (then it counts as failed)")
    check_reward: str = _f("auto", "a reward logged every step at weight 0 (never trained on) for the reward-hacking "
                                   "monitor: auto (the built-in addition task's independent verifier), none, or a "
                                   "name or module:function")
    hacking_window: int = _f(6, "steps the reward-hacking monitor looks back: a warning when over them the training "
                                "reward trends up and the check reward down (each slope 2 standard errors from 0)")
    format_weight: float = _f(0.1, "weight of the <think>/<answer> format reward added to the correctness reward")
    overlong_cache: int = _f(0, "DAPO's soft overlong punishment, added to the reward: a completion longer than "
                                "max_new_tokens - overlong_cache tokens loses up to 1, linearly (0: off)")
    length_reward_weight: float = _f(0.0, "weight of Kimi k1.5's length reward (within a group, shorter right "
                                          "answers earn up to +0.5, long wrong ones pay up to -0.5; 0: off)")
    calibration_weight: float = _f(0.0, "RLCR: weight of the Brier-score reward on the confidence stated after the "
                                        "answer in <confidence> tags (reward = correct - weight * (confidence - "
                                        "correct)^2; 1 is RLCR; 0: off). Real models are asked for the tag")
    system_prompt: str = _f("auto", "system message before every prompt: 'auto' (the <think>/<answer> format "
                                    "instruction, except for built-in models, which learned the format), 'none', "
                                    "or the text itself")
    # model and adapter; the objective (localrl.objectives)
    quantize: str = _f("auto", "base weights: 'nf4' (4-bit, bitsandbytes; --4bit), 'none' (full precision; "
                               "--no-4bit), or 'auto': nf4 on a GPU, full precision on a CPU (4-bit decoding is "
                               "slower there) unless the memory budget or free memory needs nf4")
    compute_dtype: str = _f("auto", "the number format the base computes in: 'auto' (bfloat16 on a GPU, float32 on "
                                    "a CPU: on CPUs that multiply bfloat16, AVX-512 BF16, AMX or ARM BF16, it has not "
                                    "yet learned as float32 does), "
                                    "'float32' or 'bfloat16'; the adapter, its optimizer state, log-probabilities "
                                    "and the loss are float32 under either")
    lora_rank: int = _f(16, "LoRA rank")
    lora_alpha: int = _f(32, "LoRA scaling numerator (scale = alpha / rank)")
    lora_dropout: float = _f(0.0, "dropout on the LoRA input")
    lora_targets: str = _f("all-linear", "comma-separated module names to adapt, or 'all-linear'")
    unsloth: bool = _f(False, "load through Unsloth's CUDA fast path (needs the 'unsloth' extra and a GPU)")
    objective: str = _f("grpo", "what a step optimises: an objective of those listed above, or "
                                "package.module:Class")
    init_adapter: str = _f("", "start from this adapter instead of a fresh one: a run directory (its newest "
                               "checkpoint, e.g. a `localrl sft` run) or a PEFT adapter directory, trained on the "
                               "same base with the same LoRA settings")
    # the step: prompts, group, completion budget (training/length_schedule.py)
    steps: int = _f(40, "optimizer steps (each on a fresh batch of prompts)")
    prompts_per_step: int = _f(16, "prompts per step; each gets group_size completions")
    group_size: int = _f(8, "completions sampled per prompt (G)")
    max_new_tokens: int = _f(64, "longest completion, in tokens (under a budget_schedule: at the first step)")
    budget_schedule: str = _f("constant", "how the completion budget goes from max_new_tokens to "
                                          "max_new_tokens_final over the run: constant, linear, or step (equal "
                                          "stages; Curriculum GRPO's shrinking budget)")
    max_new_tokens_final: int = _f(0, "the budget at the last step under a linear or step schedule, at most "
                                      "max_new_tokens (0: max_new_tokens)")
    budget_stages: int = _f(2, "step schedule: equal stages of the run, the budget falling in equal steps "
                               "from max_new_tokens in the first to max_new_tokens_final in the last")
    # sampling: the completions sampler (samplers/completions.py)
    sampler: str = _f("", "who samples a step's rollouts: a sampler of those listed above, or package.module:Class; "
                          "empty picks by the other fields (an environment's episodes with env, Markovian traces "
                          "with markovian_chunk, prompt completions otherwise)")
    temperature: float = _f(1.0, "sampling temperature for rollouts")
    rollout: str = _f("auto", "who samples the completions: 'torch', 'llama.cpp' (batched, the adapter attached as "
                              "a GGUF LoRA each step; needs the llama extra), or 'auto': llama.cpp on a CPU when "
                              "installed, else torch")
    rollout_is: str = _f("sequence_mask", "importance weights for completions llama.cpp sampled: token_truncate, "
                                          "token_mask, sequence_truncate, sequence_mask (TRL's modes) or none")
    rollout_is_cap: float = _f(3.0, "importance weight cap: larger weights are clipped (truncate) or zeroed (mask)")
    dynamic_sampling: bool = _f(False, "DAPO's dynamic sampling: groups whose rewards are all equal are set aside "
                                       "and more prompts sampled until prompts_per_step groups differ (prompts, "
                                       "not env episodes)")
    dynamic_sampling_rounds: int = _f(3, "dynamic sampling: extra rounds of prompts_per_step prompts at most, per step")
    # the policy loss, TRL's names and defaults (policy/losses.py; LossSettings is a view of these)
    num_iterations: int = _f(1, "optimisation passes over each batch of rollouts (PPO epochs)")
    loss_type: str = _f("grpo", "the policy loss, as TRL names it: grpo (each completion's mean, then over "
                                "completions), bnpo / dapo (over all tokens of the step), dr_grpo (token sum / "
                                "(completions x max_new_tokens): no length bias), cispo (clipped detached ratio x "
                                "log-prob), sapo (soft gate), luspo (each completion's sum), vespo (gamma weight); "
                                "objective dpo: sigmoid (DPO), ipo, hinge, robust, sft (the chosen completions' "
                                "NLL), or several comma-separated, summed by loss_weights (sigmoid,sft: RPO)")
    importance_sampling_level: str = _f("token", "policy ratio per 'token', or per 'sequence' (GSPO: the exponent of "
                                                 "the completion's mean log-ratio)")
    epsilon: float = _f(0.2, "clipping range of the policy ratio (its lower side, when epsilon_high is set)")
    epsilon_high: float = _f(0.0, "upper clipping range (DAPO's clip-higher, e.g. 0.28); for cispo the cap on the "
                                  "ratio itself (e.g. 5.0); 0: epsilon")
    delta: float = _f(0.0, "two-sided clipping (INTELLECT-2): cap on the unclipped ratio, e.g. 1.5 (> 1 + epsilon); "
                           "0: off")
    scale_rewards: str = _f("group", "divide advantages by the reward std of each 'group', of the 'batch', or "
                                     "'none' (Dr. GRPO)")
    use_bias_correction_kl: bool = _f(True, "multiply the KL term by the policy ratio (DeepSeek-V3.2's unbiased "
                                            "reverse-KL gradient), as TRL does by default")
    sapo_temperature_pos: float = _f(1.0, "sapo: temperature of the soft gate for positive advantages")
    sapo_temperature_neg: float = _f(1.05, "sapo: temperature of the soft gate for the others")
    vespo_k_pos: float = _f(2.0, "vespo: exponent k of the gamma weight for non-negative advantages")
    vespo_lambda_pos: float = _f(3.0, "vespo: rate lambda of the gamma weight for non-negative advantages")
    vespo_k_neg: float = _f(3.0, "vespo: exponent k for negative advantages")
    vespo_lambda_neg: float = _f(2.0, "vespo: rate lambda for negative advantages")
    top_entropy_quantile: float = _f(1.0, "keep in the policy loss only this top fraction of the step's tokens by "
                                          "entropy (Beyond the 80/20 Rule: 0.2); 1.0: all")
    entropy_coef: float = _f(0.0, "entropy bonus: minus this times the mean token entropy is added to the loss "
                                  "(on the tokens the policy loss keeps)")
    use_adaptive_entropy: bool = _f(False, "Skywork-OR1's adaptive entropy control: the bonus applies while the "
                                           "entropy is at most entropy_target, and its coefficient rises by "
                                           "entropy_coef_delta after each step below the target, falls otherwise")
    entropy_target: float = _f(0.2, "adaptive entropy: target mean token entropy (nats)")
    entropy_coef_delta: float = _f(0.005, "adaptive entropy: step of the coefficient")
    entropy_coef_min: float = _f(0.0, "adaptive entropy: lowest coefficient")
    entropy_coef_max: float = _f(1.0, "adaptive entropy: highest coefficient")
    off_policy_mask_threshold: float = _f(0.0, "DeepSeek-V3.2's off-policy sequence mask: drop completions with a "
                                               "negative advantage whose mean log-ratio to the sampler exceeds "
                                               "this; 0: off")
    # KL to the reference (policy/reference.py)
    beta: float = _f(0.04, "weight of the KL penalty to the base model (0 disables it); objective dpo: DPO's beta, "
                           "how far the preferences may move the policy from the reference (0.1, TRL's, by its "
                           "preset)")
    sync_ref_model: bool = _f(False, "TR-DPO: every ref_model_sync_steps steps the KL reference becomes a mix of "
                                     "the adapter and the old reference (an adapter state: no second copy of the base)")
    ref_model_mixup_alpha: float = _f(0.6, "sync: ref = alpha x policy + (1 - alpha) x ref, of the LoRA factors "
                                           "(1.0: a hard reset of the reference to the policy)")
    ref_model_sync_steps: int = _f(512, "sync: steps between reference syncs")
    reset_optimizer_on_sync: bool = _f(False, "sync: also clear AdamW's moments at every sync (the prolonged-RL "
                                              "recipe of KL plus periodic resets)")
    # optimiser and memory
    lr: float = _f(2e-3, "AdamW learning rate of the adapter")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_grad_norm: float = _f(1.0, "gradient norm clip (0 disables it)")
    micro_batch_size: int = _f(0, "completions per forward/backward chunk (0: all at once)")
    prompt_cache: bool = _f(True, "compute each prompt once per group (--no-prompt-cache: concatenate per row)")
    memory_budget: str = _f("", "peak memory of a training step, e.g. 10GB: sets micro-batches, logits chunks "
                                "and checkpointing (empty: micro_batch_size applies)")
    # agent training: the episodes sampler (samplers/episodes.py) and the shell environment (envs/shell.py)
    env: str = _f("", "train an agent in an environment of those listed above, or package.module:function; empty: "
                      "train on the data's prompts")
    env_tasks: str = _f("", "the shell environment's tasks: empty for the built-in generator, a JSONL file of "
                            "{instruction, files, check} lines, or module:function returning ShellTasks")
    env_families: str = _f("", "comma-separated task families to train on (count, files, edit, csv, multi); empty: "
                               "all. The held-out evaluation always covers every family and level")
    env_levels: str = _f("", "comma-separated difficulty levels to train on (1, 2, 3), for a curriculum; empty: all")
    max_turns: int = _f(4, "model turns per episode, each at most max_new_tokens; an episode ends at its answer")
    process_reward: str = _f("", "a user's process reward, package.module:function(state) -> float, called after each "
                                 "turn with the environment's state (the shell's: instruction, workdir, turns, "
                                 "answer); replaces the environment's own turn rewards (what turn_grpo credits)")
    env_workers: int = _f(8, "environment steps (sandboxed commands, a world model's questions) run at once")
    env_timeout: float = _f(5.0, "seconds a command may run in the sandbox")
    isolation: str = _f("auto", "sandbox isolation: auto (the strongest that works here), bwrap, landlock, "
                                "unshare or process")
    mask_truncated_completions: bool = _f(False, "leave episodes that never answered (turn or context limit) out "
                                                 "of the loss, as TRL's option does; they still count in their "
                                                 "group's advantages")
    # evaluation, checkpoints, the run
    eval_size: int = _f(200, "held-out problems for accuracy before and after training (0 skips)")
    eval_batch_size: int = _f(64, "prompts per greedy decoding batch during evaluation")
    save_every: int = _f(10, "checkpoint every N steps (and always at the end or on Ctrl-C)")
    keep_checkpoints: int = _f(2, "checkpoints kept on disk (older ones are deleted)")
    seed: int = _f(0, "seed of data order, sampling and initialisation")
    run_dir: str = _f("", "run directory; empty: runs/<date>-<time>")
    report_to: str = _f("none", "experiment trackers that also get the run's records, comma-separated (TRL's "
                                "name): none, tensorboard (event files in the run directory), trackio (its local "
                                "store), or package.module:Class")
    device: str = _f("auto", "auto, cpu or cuda")
    threads: int = _f(0, "CPU threads for torch and llama.cpp rollouts (0: torch's default, OMP_NUM_THREADS or "
                           "all cores)")

    def validate(self) -> "TrainConfig":
        """Raise UserError naming the first impossible setting of the config's own fields; returns self. The
        plug-ins' settings are checked by ``localrl.training.settings.check_config``, which calls this first."""
        checks = [
            ("group_size", self.group_size >= 2, "must be at least 2 (advantages compare completions within a group)"),
            ("max_new_tokens", self.max_new_tokens >= 1, "must be at least 1"),
            ("budget_schedule", self.budget_schedule in ("constant", "linear", "step"),
             "must be constant, linear or step"),
            ("max_new_tokens_final", 0 <= self.max_new_tokens_final <= self.max_new_tokens,
             f"must be between 1 and max_new_tokens ({self.max_new_tokens}), or 0 (max_new_tokens)"),
            ("max_new_tokens_final", self.max_new_tokens_final == 0 or self.overlong_cache <= self.max_new_tokens_final,
             f"must be at least overlong_cache ({self.overlong_cache})"),
            ("budget_stages", self.budget_stages >= 2, "must be at least 2"),
            ("hacking_window", self.hacking_window >= 3, "must be at least 3"),
            ("length_reward_weight", self.length_reward_weight >= 0, "must be non-negative (0: off)"),
            ("calibration_weight", self.calibration_weight >= 0, "must be non-negative (0: off)"),
            ("steps", self.steps >= 1, "must be at least 1"),
            ("prompts_per_step", self.prompts_per_step >= 1, "must be at least 1"),
            ("temperature", self.temperature > 0, "must be positive (rollouts are sampled)"),
            ("num_iterations", self.num_iterations >= 1, "must be at least 1"),
            ("epsilon", 0 < self.epsilon < 1, "must be in (0, 1)"),
            ("epsilon_high", self.epsilon_high >= 0, "must be non-negative (0: epsilon)"),
            ("delta", self.delta == 0 or self.delta > 1, "must be 0 (off) or above 1"),
            ("importance_sampling_level", self.importance_sampling_level in ("token", "sequence"),
             "must be token or sequence"),
            ("top_entropy_quantile", 0 <= self.top_entropy_quantile <= 1, "must be in [0, 1]"),
            ("entropy_coef_delta", self.entropy_coef_delta >= 0, "must be non-negative"),
            ("entropy_coef_max", self.entropy_coef_min <= self.entropy_coef_max,
             f"must be at least entropy_coef_min ({self.entropy_coef_min})"),
            ("off_policy_mask_threshold", self.off_policy_mask_threshold >= 0, "must be non-negative (0: off)"),
            ("scale_rewards", self.scale_rewards in SCALE_REWARDS, f"must be one of {', '.join(SCALE_REWARDS)}"),
            *[(name, getattr(self, name) > 0, "must be positive") for name in (
                "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                "vespo_lambda_neg")],
            ("beta", self.beta >= 0, "must be non-negative"),
            ("sync_ref_model", not self.sync_ref_model or self.beta > 0,
             "needs beta > 0 (the reference is used by the KL term only)"),
            ("ref_model_mixup_alpha", 0 < self.ref_model_mixup_alpha <= 1, "must be in (0, 1]"),
            ("ref_model_sync_steps", self.ref_model_sync_steps >= 1, "must be at least 1"),
            ("judge_concurrency", self.judge_concurrency >= 1, "must be at least 1"),
            ("judge_timeout", self.judge_timeout > 0, "must be positive"),
            ("judge_retries", self.judge_retries >= 0, "must be non-negative"),
            ("lr", self.lr > 0, "must be positive"),
            ("weight_decay", self.weight_decay >= 0, "must be non-negative"),
            ("max_grad_norm", self.max_grad_norm >= 0, "must be non-negative"),
            ("micro_batch_size", self.micro_batch_size >= 0, "must be non-negative"),
            ("lora_rank", self.lora_rank >= 1, "must be at least 1"),
            ("lora_alpha", self.lora_alpha >= 1, "must be at least 1"),
            ("lora_dropout", 0 <= self.lora_dropout < 1, "must be in [0, 1)"),
            ("format_weight", self.format_weight >= 0, "must be non-negative"),
            ("overlong_cache", 0 <= self.overlong_cache <= self.max_new_tokens,
             f"must be between 0 and max_new_tokens ({self.max_new_tokens})"),
            ("eval_size", self.eval_size >= 0, "must be non-negative"),
            ("eval_batch_size", self.eval_batch_size >= 1, "must be at least 1"),
            ("save_every", self.save_every >= 1, "must be at least 1"),
            ("keep_checkpoints", self.keep_checkpoints >= 1, "must be at least 1"),
            ("threads", self.threads >= 0, "must be non-negative"),
            ("device", self.device in ("auto", "cpu", "cuda"), "must be auto, cpu or cuda"),
            ("quantize", self.quantize in ("auto", "nf4", "none"), "must be auto, nf4 or none"),
            ("compute_dtype", self.compute_dtype in ("auto", "float32", "bfloat16"),
             "must be auto, float32 or bfloat16"),
            ("rollout", self.rollout in ("auto", "torch", "llama.cpp"), "must be auto, torch or llama.cpp"),
            ("rollout_is", self.rollout_is == "none" or self.rollout_is in IS_MODES,
             f"must be none or one of TRL's modes: {', '.join(IS_MODES)}"),
            ("rollout_is_cap", self.rollout_is_cap >= 1, "must be at least 1"),
            ("objective", bool(self.objective.strip()), "must name an objective (localrl train -h lists them)"),
            ("model", bool(self.model.strip()), "must not be empty"),
            ("data", bool(self.data.strip()), "must not be empty"),
        ]
        self.check_numbers()
        check_fields(self, checks)
        if self.memory_budget:
            from localrl.memory import parse_bytes

            parse_bytes(self.memory_budget)
        return self

    def check_numbers(self) -> None:
        """Every field's number, the plug-ins' included: finite (inf and nan pass every comparison of a check or
        none), and no count past what any run needs (a typo's extra zeros)."""
        for name in FIELDS:
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"config field {name}: must be a finite number (got {value!r})", field=name)
            if name == "seed" and not 0 <= value <= MAX_SEED:
                raise UserError(f"config field seed: must be from 0 to {MAX_SEED:,} (got {value})", field=name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT:
                raise UserError(f"config field {name}: {value} is more than any run needs (at most {MAX_INT:,})",
                                field=name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}  # every field, the plug-ins' included (add_settings)
_CORE_FIELDS = dataclasses.fields(TrainConfig)
_SETTINGS: dict[str, type] = {}  # owner ("objective ppo") -> its settings dataclass


def add_settings(owner: str, settings: type | None) -> None:
    """Make the fields of ``settings``, the settings dataclass of the plug-in ``owner`` ("objective ppo"), fields of
    ``TrainConfig``: a flag, a TOML key and a line of ``localrl train -h`` each, under the owner's heading, with
    the default a config has when nothing sets it (``localrl.registry`` calls this as a plug-in registers; the
    plug-in checks its fields and says which it owns). ``None`` takes the owner's settings away again.

    Plug-ins that share one settings dataclass share its fields; a field another plug-in (or the core) already
    defines is a ValueError: one meaning a flag."""
    if settings is None:
        _SETTINGS.pop(owner, None)
    else:
        if not dataclasses.is_dataclass(settings):
            raise ValueError(f"{owner}: settings must be a dataclass of config fields (localrl.config.setting)")
        taken = {f.name: "the core config" for f in _CORE_FIELDS} | {
            f.name: other for other, s in _SETTINGS.items() if other != owner and s is not settings
            for f in dataclasses.fields(s)}
        for f in dataclasses.fields(settings):
            if f.name in taken:
                raise ValueError(f"{owner}: setting {f.name!r} is already a field of {taken[f.name]}")
            if "help" not in f.metadata or f.default is dataclasses.MISSING:
                raise ValueError(f"{owner}: setting {f.name!r} needs a default and a help line "
                                 f"(localrl.config.setting)")
        _SETTINGS[owner] = settings
    _assemble()


def _assemble() -> None:
    """TrainConfig's fields: the core's, then each plug-in's, by owner. The class is made a dataclass again in
    place, with every field, so that every import of it, and every config made from now on, has them all."""
    fields = {f.name: f for f in _CORE_FIELDS}
    for owner in sorted(_SETTINGS):
        for f in dataclasses.fields(_SETTINGS[owner]):
            fields.setdefault(f.name, f)
    for name in set(FIELDS) - set(fields):
        delattr(TrainConfig, name)
    for made in ("__init__", "__repr__", "__eq__", "__hash__", "__match_args__"):  # made by @dataclass: made anew
        if made in vars(TrainConfig):
            delattr(TrainConfig, made)
    TrainConfig.__annotations__ = {name: f.type for name, f in fields.items()}
    for name, f in fields.items():
        setattr(TrainConfig, name, f)
    dataclass(TrainConfig)
    FIELDS.clear()
    FIELDS.update(fields)


def plugin_settings() -> list[tuple[str, type]]:
    """(heading, settings dataclass) of each plug-in's settings, in field order; plug-ins sharing one dataclass
    share a heading ("env shell, shell_drafts"). A heading is the owners, then the dataclass's docstring."""
    owners: dict[type, list[str]] = {}
    for owner in sorted(_SETTINGS):
        owners.setdefault(_SETTINGS[owner], []).append(owner)
    out = []
    for settings, names in owners.items():
        kind = names[0].partition(" ")[0]
        heading = f"{kind} " + ", ".join(n.partition(" ")[2] for n in names)
        doc = (settings.__doc__ or "").strip()
        if doc and not doc.startswith(settings.__name__ + "("):  # (not the signature @dataclass writes)
            heading += f" ({doc.splitlines()[0].rstrip('.')})"
        out.append((heading, settings))
    return out
MAX_INT = 10**9  # no count in a run (steps, tokens, tasks, ranks) comes near it; a typo's extra zeros do
MAX_SEED = 2**32 - 1  # seeds are mixed with the step into 64-bit generator seeds


def check_fields(cfg: TrainConfig, checks: list[tuple[str, bool, str]]) -> None:
    """Raise the first failed check of ``checks`` (field, holds, why) as one line naming the field and its value:
    the config's own checks, and those of each plug-in's settings (``check_settings``)."""
    for name, ok, why in checks:
        if not ok:
            raise UserError(f"config field {name}: {why} (got {getattr(cfg, name)!r})", field=name)


def unknown_items(listing: str, allowed: tuple[str, ...]) -> list[str]:
    """The items of a comma-separated ``listing`` not in ``allowed``."""
    return [item for item in split_list(listing) if item not in allowed]


def split_list(listing: str) -> list[str]:
    """'a, b,c' -> ['a', 'b', 'c']."""
    return [item.strip() for item in listing.split(",") if item.strip()]
