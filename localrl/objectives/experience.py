"""Training-free GRPO as an objective (the library, its edits and the judge are ``localrl.policy.experience``): each
step samples and scores the groups of its prompts with the library's lessons in the system message, then
lets the judge edit the library after each group whose completions part into right and wrong. No weight
changes. The library is the run's state: written after every step, kept with every checkpoint, and given
to the model in every evaluation (``system``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from localrl.config import check_fields, setting
from localrl.errors import UserError
from localrl.objectives import Objective, StepContext, objectives, step_record
from localrl.generation.endpoint import Endpoint, EndpointSettings, is_endpoint
from localrl.policy.experience import (MAX_LESSON_CHARS, EndpointJudge, ExperienceLibrary, Judge, check_judge_fits,
                                       contrasting_pairs, initial_library, judge_load, judge_request,
                                       library_tokens, parse_edits, question_text, reply_start, token_room)


# the judge's replies in a row without a single edit line (prose) that stop the run in one line
PROSE_IN_A_ROW = 32


@dataclass
class ExperienceSettings:
    """training-free GRPO: the lessons and their judge"""

    experience_judge: str = setting("", "objective experience: the model that compares each group's right and wrong "
                                        "completions and edits the lessons (a model source as for model, or an "
                                        "OpenAI-compatible endpoint: http://HOST:PORT/v1|MODEL; empty: the policy "
                                        "model itself)")
    experience_size: int = setting(12, "objective experience: the most lessons the library holds (an addition to a "
                                       "full one drops the oldest)")
    experience_init: str = setting("", "objective experience: start from this library (a run directory's "
                                       "experience.json or such a file: lessons by a larger judge, or written by "
                                       "hand); empty: none")
    experience_judge_tokens: int = setting(96, "objective experience: the longest reply of the judge, in tokens")
    experience_tokens: int = setting(0, "objective experience: the room the lessons get in every prompt, in tokens, "
                                        "held free in the context (an addition drops the oldest lessons to fit, an "
                                        "edit that cannot is invalid); 0: a quarter of the context, at most 256")


@objectives.register("experience")
class Experience(Objective):
    about = "training-free GRPO: no weight changes, lessons distilled from each group into the run's experience library"
    settings = ExperienceSettings

    def __init__(self, cfg):
        super().__init__(cfg)
        self.library: ExperienceLibrary | None = None
        self.judge: Judge | EndpointJudge | None = None
        self.endpoint: Endpoint | None = None  # the judge behind an HTTP endpoint (experience_judge = http://...)
        self.room = 0  # tokens the lessons may take in each prompt (0: unbounded)
        self.prose = 0  # the judge's replies in a row that held no edit line at all

    @staticmethod
    def check_selected(cfg) -> None:
        check_fields(cfg, [
            ("objective", not (cfg.env or cfg.markovian_chunk),
             "experience is for single-turn tasks without markovian_chunk"),
            ("dynamic_sampling", not cfg.dynamic_sampling,
             "experience judges each step's groups as sampled (not with objective experience)"),
        ])

    @staticmethod
    def check_settings(cfg) -> None:
        check_fields(cfg, [
            ("experience_size", cfg.experience_size >= 1, "must be at least 1"),
            ("experience_judge_tokens", cfg.experience_judge_tokens >= 1, "must be at least 1"),
            ("experience_tokens", cfg.experience_tokens >= 0, "must be non-negative (0: a quarter of the context)"),
        ])

    def check(self, w) -> None:
        if w.distributed:
            raise UserError(f"config field objective: experience keeps one library in one process; launch it "
                            f"without torchrun (this launch has {w.size} ranks)", field="objective")

    def prompt_tokens(self, info) -> int:
        """The lessons' room in every prompt (``experience_tokens``): the sampler keeps it free in the context."""
        self.room = library_tokens(self.cfg.experience_tokens, info.context)
        return self.room

    def preflight(self, info, sampler, plan):
        """The library to start from must read; the judge (the policy model, or ``experience_judge``) must hold a
        request and its reply; its weights and replies are in the run's memory plan."""
        from localrl.memory import ModelShape, check_conversion, frozen_bytes
        from localrl.modeling import check_weights, default_4bit, load_config, load_tokenizer

        cfg = self.cfg
        try:
            initial_library(cfg.experience_size, cfg.experience_init)
        except UserError as e:
            raise UserError(f"config field experience_init: {e}", field="experience_init") from None
        shape = ModelShape.from_config(info.config)
        if is_endpoint(cfg.experience_judge):  # answers elsewhere: no weights here; unreachable is one line now
            self.endpoint = Endpoint(cfg.experience_judge, "experience_judge", EndpointSettings.of(cfg))
            self.endpoint.check()
            return "", None
        if not cfg.experience_judge:
            check_judge_fits(info.tok, info.context, cfg.max_new_tokens, cfg.experience_judge_tokens,
                             f"the policy model {cfg.model} (the judge while experience_judge is empty)")
            return "", judge_load(cfg, info.tok, info.context, shape, 0, plan.longest_prompt)
        check_conversion(cfg, cfg.experience_judge, info.device)
        try:
            path, config = load_config(cfg.experience_judge)
        except UserError as e:
            raise UserError(f"config field experience_judge: {e}", field="experience_judge") from None
        check_weights(path)
        judge_tok, judge_context = load_tokenizer(path), getattr(config, "max_position_embeddings", None)
        check_judge_fits(judge_tok, judge_context, cfg.max_new_tokens, cfg.experience_judge_tokens,
                         f"the judge {cfg.experience_judge}")
        judge_shape = ModelShape.from_config(config)
        weights = frozen_bytes(judge_shape, default_4bit(cfg.quantize, info.device), info.device, cfg.compute_dtype)
        return path, judge_load(cfg, judge_tok, judge_context, judge_shape, weights, plan.longest_prompt)

    def setup(self, ctx: StepContext, state: dict) -> None:
        """The library (a checkpoint's, or the one to start from) and the judge: the policy model itself, or the
        ``experience_judge`` model (frozen, no adapter)."""
        from localrl.modeling import default_4bit, load_base, load_tokenizer

        cfg = self.cfg
        self.library = initial_library(cfg.experience_size, cfg.experience_init)
        if "experience" in state:  # the library the checkpoint's step had
            self.library = replace(ExperienceLibrary.from_state(state["experience"]), capacity=cfg.experience_size)
        if self.room:
            self.library.within = token_room(ctx.tok, self.room)
            dropped = self.library.trim()
            if dropped:
                ctx.log(f"experience: {dropped} of the oldest lessons left out, the rest fit the {self.room} tokens "
                        f"of experience_tokens")
        if self.endpoint is not None:
            self.judge = EndpointJudge(self.endpoint, cfg.experience_judge_tokens)
            return
        at_once = ctx.budget.extra_at_once()  # as many requests at a time as the memory budget holds
        if not ctx.extra_model_path:
            self.judge = Judge(ctx.model, ctx.tok, cfg.experience_judge_tokens,
                               getattr(ctx.model.config, "max_position_embeddings", None), at_once)
            return
        judge = load_base(ctx.extra_model_path, default_4bit(cfg.quantize, ctx.device), ctx.device,
                          cfg.compute_dtype)
        self.judge = Judge(judge, load_tokenizer(ctx.extra_model_path), cfg.experience_judge_tokens,
                           getattr(judge.config, "max_position_embeddings", None), at_once)

    def system(self, base: str | None) -> str | None:
        return self.library.system(base) if self.library is not None else base

    def step(self, ctx: StepContext, step: int, tokens: int) -> dict:
        cfg, library = self.cfg, self.library
        t0 = time.time()
        batch = ctx.sampler.sample(ctx, step, tokens, self.system)
        g = cfg.group_size
        pairs = contrasting_pairs(batch.rows, batch.texts, batch.scores[0], g)
        requests = [judge_request(question_text(row["prompt"]), str(row["answer"]), right, wrong, library)
                    for row, right, wrong in pairs]
        replies = self.judge(requests, reply_start(library))
        changed = invalid = 0
        for reply in filter(None, replies):
            edits = parse_edits(reply)
            self.prose = 0 if edits else self.prose + 1
            if self.prose >= PROSE_IN_A_ROW:  # a run that can never learn a lesson is said, not left to exit 0
                raise UserError(f"config field experience_judge: the judge's last {self.prose} replies held no edit "
                                f"(a line ADD, MODIFY, DELETE or KEEP), so the library cannot learn; the last: "
                                f"{' '.join(reply.split())[:100]!r} (a judge that follows the format: a larger "
                                f"model, or an endpoint)", field="experience_judge")
            c, i = library.apply(edits)
            changed, invalid = changed + c, invalid + i
        groups = batch.rewards.view(-1, g)
        flat = (groups == groups[:, :1]).all(dim=1).float().mean().item()  # groups whose rewards are all alike
        no_update = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "micro_batch": 0, "frac_reward_zero_std": flat}
        record = step_record(step, batch.rewards, batch.scores, batch.names, no_update, batch.lengths,
                             batch.truncated, t0, batch.gen_s, 0.0, ctx.device)
        return {
            **record,
            "lessons": len(library.lessons),
            "judged_groups": len(requests),
            "judge_too_long": sum(r is None for r in replies),
            "edits": changed,
            "invalid_edits": invalid,
            "judge_reply": next((r[:MAX_LESSON_CHARS] for r in replies if r), ""),  # the first, to see what it writes
            **(self.judge.take_stats() if isinstance(self.judge, EndpointJudge) else {}),
        }

    def after_step(self, ctx: StepContext, step: int, record: dict) -> None:
        if ctx.world.is_main:
            self.library.save(ctx.run.experience_path)

    def state(self) -> dict:
        return {"experience": self.library.state()}
