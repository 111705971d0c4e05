"""Multi-turn rollouts: G episodes of each task, the model's turns sampled in batches, the
environment's steps run in parallel, and each whole trajectory returned as one completion.

An episode's tokens after the shared prompt interleave the model's turns with what the
environment adds: the end of the assistant turn when the model did not write it, the tool
response as the next message, and the template's header of the next assistant turn. All of
it is attended to; only the model's own sampled tokens are trained on (``loss_mask``). The
environment's tokens come from the chat template, rendered for the new messages only, so the
context is exactly what the model saw when it sampled each turn (templates that rewrite
earlier turns, such as stripping old reasoning, are never applied after the fact).

A turn ends at a stop token, at the first ``</tool_call>`` (as a stop string would; the rest
is never used), or after ``max_new_tokens``. An episode ends when the environment says so (a
final answer, or its turn limit) or when the next turn would not fit the model's context;
episodes that never answered are ``truncated``.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from localrl.agent.tool_calls import tool_response
from localrl.envs import Environment
from localrl.errors import UserError
from localrl.generation.rollout import Rollout, left_pad, sample_groups

TOOL_CALL_END = "</tool_call>"
SHELL_TOOL = {"type": "function", "function": {
    "name": "shell", "description": "Run a bash command in the task's working directory; returns its output and exit code.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "the command"}},
                   "required": ["command"]}}}
MAX_OBSERVATION_TOKENS = 256  # a tool's output beyond this is cut in the middle before the model sees it
_SENTINEL = "\u2063LOCALRL\u2063"


class TurnFormat:
    """The tokens the chat template puts around turns, for one tokenizer and system prompt.

    A template that takes ``tools`` (Qwen 2.5/3, Hermes-style) is given the shell tool's schema, and one
    that renders a ``tool`` role gets the observations in that role, so such a model sees the tool
    format it was tuned on; other templates get the observations as user messages in
    ``<tool_response>`` tags (what the built-in agent learned, and what any template can carry).
    """

    def __init__(self, tok, system: str | None):
        self.tok = tok
        self.system = system
        template = tok.chat_template if isinstance(tok.chat_template, str) else ""
        self.tools = [SHELL_TOOL] if re.search(r"\btools\b", template) else None
        self.tool_role = bool(re.search(r"""['"]tool['"]""", template))
        self.base = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "x"}]
        if tok.chat_template:
            done = self._render(self.base + [{"role": "assistant", "content": _SENTINEL}])
            self.close = done[done.index(_SENTINEL) + len(_SENTINEL):]  # after an assistant message, e.g. <|im_end|>\n
            self._after_assistant = done
            probe = self._render(self.base + [{"role": "assistant", "content": _SENTINEL}, self._message("x")], True)
            if not probe.startswith(done):
                raise UserError("model's chat template: it rewrites earlier turns when a tool result follows; "
                                "multi-turn rollouts need a template that only appends")
        else:
            self.close = "\n"

    def _message(self, observation: str) -> dict:
        return {"role": "tool", "content": observation} if self.tool_role else tool_response(observation)

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                            **({"tools": self.tools} if self.tools else {}))

    def prompt_ids(self, instruction: str) -> list[int]:
        messages = self.base[:-1] + [{"role": "user", "content": instruction}]
        if self.tok.chat_template:
            return self.tok(self._render(messages, True), add_special_tokens=False)["input_ids"]
        return self.tok("\n".join(m["content"] for m in messages) + "\n")["input_ids"]

    def between(self, turn_ids: list[int], observation: str, max_tokens: int = MAX_OBSERVATION_TOKENS) -> list[int]:
        """The environment's tokens after a model turn: the rest of the turn's closing, the observation as
        the next message (its middle left out beyond ``max_tokens`` tokens), and the header of the next
        assistant turn."""
        ids = self.tok(observation, add_special_tokens=False)["input_ids"]
        if len(ids) > max_tokens:
            half = max_tokens // 2
            observation = (self.tok.decode(ids[:half]) + f"\n[... {len(ids) - 2 * half} tokens left out ...]\n"
                           + self.tok.decode(ids[-half:]))
        closing = self.close
        turn_text = self.tok.decode(turn_ids, skip_special_tokens=False)
        for k in range(len(closing), 0, -1):  # the model may have written the start of the closing itself
            if turn_text.endswith(closing[:k]):
                closing = closing[k:]
                break
        message = self._message(observation)
        if self.tok.chat_template:
            rendered = self._render(self.base + [{"role": "assistant", "content": _SENTINEL}, message], True)
            text = closing + rendered[len(self._after_assistant):]
        else:
            text = closing + message["content"] + "\n"
        return self.tok(text, add_special_tokens=False)["input_ids"]


def trajectory_budget(fmt: TurnFormat, max_turns: int, max_new_tokens: int) -> int:
    """The most tokens an episode's trajectory can hold: every turn at its limit, every observation at
    its cap (with the template's tokens around it, and the cap's note)."""
    around = len(fmt.between([], "")) + 16
    return max_turns * max_new_tokens + (max_turns - 1) * (MAX_OBSERVATION_TOKENS + around)


def cut_at_tool_call(tok, ids: list[int]) -> list[int]:
    """``ids`` up to the token that completes the first ``</tool_call>``, if there is one."""
    if TOOL_CALL_END not in tok.decode(ids, skip_special_tokens=False):
        return ids
    lo, hi = 1, len(ids)  # the shortest prefix that contains it
    while lo < hi:
        mid = (lo + hi) // 2
        if TOOL_CALL_END in tok.decode(ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo]


@dataclass
class Episode:
    env: Environment
    prompt: int  # index of the task's prompt
    tokens: list[int] = field(default_factory=list)  # after the prompt: the model's turns and the environment's
    own: list[int] = field(default_factory=list)  # 1 where the model sampled the token
    texts: list[str] = field(default_factory=list)  # the model's turns, decoded
    observations: list[str] = field(default_factory=list)
    done: bool = False
    answered: bool = False
    reward: float = 0.0
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # each model turn's [start, end) in tokens
    turn_rewards: list[float] = field(default_factory=list)  # the environment's reward after each turn (if any)


@dataclass
class AgentRollout:
    rollout: Rollout
    episodes: list[Episode]
    rewards: list[float]
    stats: dict  # per-step metrics of the episodes


def run_episodes(model, tok, make_env, task_seeds: list[int], group_size: int, max_new_tokens: int,
                 stop_ids: list[int], temperature: float, generator: torch.Generator | None = None,
                 max_context: int = 2048, workers: int = 8, system: str | None = None,
                 on_turn: Callable[[int], None] | None = None, tasks_at_once: int | None = None) -> AgentRollout:
    """``group_size`` episodes of each task (``task_seeds``: one environment seed per task; a group's
    episodes share it and so their task and prompt). ``make_env()`` builds one environment; ``system``: the
    system message every episode starts with (None: none); ``on_turn(finished)`` after each round of turns:
    how many episodes have ended (for progress); ``tasks_at_once``: decode at most this many tasks' episodes
    together (the memory plan's; default all)."""
    at_once = max(1, tasks_at_once or len(task_seeds))
    t0 = time.monotonic()
    fmt = TurnFormat(tok, system)
    episodes: list[Episode] = []
    prompts: list[list[int]] = []
    for b, seed in enumerate(task_seeds):
        for _ in range(group_size):
            env = make_env()
            instruction = env.reset(seed)
            episodes.append(Episode(env, b))
        prompts.append(fmt.prompt_ids(instruction))
    env_seconds, model_seconds = 0.0, 0.0
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        first = True
        while live := [e for e in episodes if not e.done]:
            t_model = time.monotonic()
            if first:  # every episode starts from its task's prompt: one prefill per task
                turns = [ids for i in range(0, len(prompts), at_once)
                         for ids in _sample(model, prompts[i:i + at_once], group_size, max_new_tokens, stop_ids,
                                            tok.pad_token_id, temperature, generator)]
                first = False
            else:
                contexts, rows = [prompts[e.prompt] + e.tokens for e in live], at_once * group_size
                turns = [ids for i in range(0, len(contexts), rows)
                         for ids in _sample(model, contexts[i:i + rows], 1, max_new_tokens, stop_ids,
                                            tok.pad_token_id, temperature, generator)]
            model_seconds += time.monotonic() - t_model
            turns = [cut_at_tool_call(tok, ids) for ids in turns]
            texts = [tok.decode(ids, skip_special_tokens=True) for ids in turns]
            t_env = time.monotonic()
            results = list(pool.map(lambda pair: (pair[0].env.step(pair[1]), _turn_reward(pair[0].env)),
                                    zip(live, texts)))
            env_seconds += time.monotonic() - t_env
            for e, ids, text, ((observation, done), turn_reward) in zip(live, turns, texts, results):
                e.turn_spans.append((len(e.tokens), len(e.tokens) + len(ids)))
                if turn_reward is not None:
                    e.turn_rewards.append(turn_reward)
                e.tokens += ids
                e.own += [1] * len(ids)
                e.texts.append(text)
                if done:
                    e.done = True
                    continue
                between = fmt.between(ids, observation)
                if len(prompts[e.prompt]) + len(e.tokens) + len(between) + max_new_tokens > max_context:
                    e.done = True  # the next turn would not fit: ends unanswered
                    continue
                e.tokens += between
                e.own += [0] * len(between)
                e.observations.append(observation)
            if on_turn is not None:
                on_turn(sum(e.done for e in episodes))
    rewards = []
    for e in episodes:
        e.reward = e.env.reward()
        e.answered = bool(getattr(getattr(e.env, "stats", None), "answered", False))
        rewards.append(e.reward)
        e.env.close()
    rollout = _assemble(prompts, episodes, group_size, tok.pad_token_id)
    return AgentRollout(rollout, episodes, rewards, _episode_stats(episodes, rewards, env_seconds, model_seconds,
                                                                   time.monotonic() - t0))


def _turn_reward(env) -> float | None:
    """The environment's process reward for the turn it just took, if it gives one."""
    give = getattr(env, "turn_reward", None)
    if give is None:
        return None
    value = give()
    return None if value is None else float(value)


def _sample(model, contexts, group_size, max_new_tokens, stop_ids, pad_id, temperature, generator) -> list[list[int]]:
    r = sample_groups(model, contexts, group_size, max_new_tokens, stop_ids, pad_id, temperature, generator)
    return [ids[mask.bool()].tolist() for ids, mask in zip(r.completion_ids, r.completion_mask)]


def _assemble(prompts: list[list[int]], episodes: list[Episode], group_size: int, pad_id: int) -> Rollout:
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    width = max(max(len(e.tokens) for e in episodes), 1)
    ids = torch.full((len(episodes), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(episodes), width, dtype=torch.long)
    own = torch.zeros(len(episodes), width, dtype=torch.long)
    for i, e in enumerate(episodes):
        n = len(e.tokens)
        ids[i, :n] = torch.tensor(e.tokens, dtype=torch.long)
        mask[i, :n] = 1
        own[i, :n] = torch.tensor(e.own, dtype=torch.long)
    truncated = torch.tensor([not e.answered for e in episodes])
    return Rollout(prompt_ids, prompt_mask, ids, mask, truncated, group_size, loss_mask=own)


def _episode_stats(episodes: list[Episode], rewards: list[float], env_s: float, model_s: float,
                   total_s: float) -> dict:
    n = len(episodes)
    stats = [getattr(e.env, "stats", None) for e in episodes]
    counted = Counter()  # what environments count beside (a world model's unread replies), summed over episodes
    for s in stats:
        counted.update(getattr(s, "counts", None) or {})

    def mean(key: str) -> float:
        return sum(getattr(s, key, 0) for s in stats) / n

    return {
        "success": sum(r == 1.0 for r in rewards) / n,
        "turns": sum(len(e.texts) for e in episodes) / n,
        "tool_calls": mean("tool_calls"),
        "invalid_calls": mean("invalid_calls"),
        "answered": sum(e.answered for e in episodes) / n,
        "model_tokens": sum(sum(e.own) for e in episodes) / n,
        "sandbox_s": round(sum(getattr(s, "sandbox_seconds", 0.0) for s in stats), 3),
        "env_s": round(env_s, 3),
        "model_s": round(model_s, 3),
        "rollout_s": round(total_s, 3),
        **counted,
    }
