"""Helpers the tests share: tiny models and tokenizers built on the fly, the CLI as a subprocess,
metrics without their timing fields, a scripted chat model, and waiting on a Textual app."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from localrl.config import TrainConfig
from localrl.metrics import read_metrics
from localrl.runs import Run

ARCH_CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}


CORPUS = ["The quick brown fox jumps over the lazy dog.", "What is 457 + 68? The answer is 525.",
          "Reinforcement learning with verifiable rewards trains small reasoning models.",
          "<think>First add the units, then the tens.</think><answer>42</answer>"] * 20


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_bpe_tokenizer(llama3_split: bool = False):
    """A GPT-2-style byte-level BPE tokenizer trained on a small corpus, with ChatML tokens and template;
    with Llama 3's split pattern (digits in groups of up to three) if ``llama3_split``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from localrl.models.pretraining import ADDED_TOKENS, CHAT_TEMPLATE, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if llama3_split:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.add_tokens(ADDED_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def train_spm_tokenizer(workdir: Path, chatml: bool = False):
    """A SentencePiece BPE model with byte fallback (as Llama 2 and Mistral ship), trained by the
    sentencepiece library and converted by transformers; with ChatML tokens and template if ``chatml``."""
    import sentencepiece
    from transformers import LlamaTokenizer

    from localrl.models.pretraining import CHAT_TEMPLATE

    workdir.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(workdir / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", minloglevel=2)
    tok = LlamaTokenizer.from_pretrained(workdir, add_bos_token=not chatml)  # Llama 2 adds <s>
    if chatml:
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.eos_token = "<|im_end|>"
        tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(out: Path, arch: str, tie: bool = False, seed: int = 0, tokenizer: str = "builtin",
                    context: int = 256) -> Path:
    """A randomly initialised ~0.2M-parameter model of ``arch`` with a tokenizer: the built-in one,
    "bpe" (trained byte-level BPE), "bpe-llama3" (the same with Llama 3's split), "spm" (trained
    SentencePiece BPE) or "spm-chatml"; ``context`` positions."""
    import transformers
    from transformers import AutoModelForCausalLM

    from localrl.models.pretraining import build_tokenizer

    if tokenizer.startswith("spm"):
        tok = train_spm_tokenizer(out.with_name(out.name + "-spm"), chatml=tokenizer == "spm-chatml")
    else:
        tok = train_bpe_tokenizer(tokenizer == "bpe-llama3") if tokenizer.startswith("bpe") else build_tokenizer()
    config = getattr(transformers, ARCH_CONFIGS[arch])(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        tie_word_embeddings=tie, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    if arch == "qwen3":
        config.head_dim = 16
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# -- the command line and runs ----------------------------------------------------------------

def run_cli(capsys, *args) -> tuple[int, list[str]]:
    """``localrl ARGS`` in this process: its exit status and the lines it wrote to stderr."""
    from localrl.cli import main

    capsys.readouterr()  # (what the test wrote before, e.g. transformers' loading bar: not this command's)
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def one_line(capsys, *args) -> str:
    """The one error line ``localrl ARGS`` stops with (exit status 2), in this process."""
    code, err = run_cli(capsys, *args)
    assert code == 2 and len(err) == 1 and err[0].startswith("localrl: error: "), err
    return err[0]


def localrl(*args, cwd=None, timeout=300, input=None) -> subprocess.CompletedProcess:
    """``python -m localrl ARGS`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "localrl", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, input=input)


TIMING_KEYS = {"tokens_per_s", "gen_s", "step_s", "wall_time", "peak_mem_mb", "sandbox_s", "env_s", "model_s",
               "rollout_s", "allreduce_s"}  # vary run to run
QUIET = {"log": lambda *_: None}


def train_records(run_dir) -> list[dict]:
    """A run's per-step records without the fields that vary from run to run."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS}
            for r in read_metrics(Run(run_dir).metrics_path) if r["kind"] == "train"]


def small(run_dir, **kw) -> TrainConfig:
    """A few-second run of the built-in model and task."""
    base = dict(prompts_per_step=4, group_size=4, max_new_tokens=48, eval_size=0, save_every=2,
                run_dir=str(run_dir), seed=7)
    return TrainConfig(**{**base, **kw}).validate()


def longer_is_better(completions, completion_ids, **_) -> list[float]:
    """A gameable reward: completion length in tokens (a policy trained on it rambles, and its answers break)."""
    return [len(ids) / 10 for ids in completion_ids]


def distinct_chars(completions, **_) -> list[float]:
    """A reward that differs between random completions, so advantages are non-zero."""
    return [float(len(set(c))) for c in completions]


# -- the terminal UI ----------------------------------------------------------------------------

async def wait_for(pilot, predicate, timeout: float = 120.0, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the UI")
        await pilot.pause(step)


class ScriptedModel:
    """A chat model that replies from a script (stands in for an LLM that can use tools; the
    tiny built-in model cannot). Records the conversations it was shown."""

    name = "scripted"

    def __init__(self, replies: list[str]):
        self.replies = list(replies)
        self.seen: list[list[dict]] = []

    def stream(self, messages, max_tokens=512, temperature=0.0, cancel=None):
        self.seen.append([dict(m) for m in messages])
        reply = self.replies.pop(0) if self.replies else "Done."
        for i in range(0, len(reply), 7):
            yield reply[i:i + 7]

    def close(self):
        pass


def tool_call(command: str) -> str:
    return "<think>I should look.</think>" + '<tool_call>{"name": "shell", "arguments": {"command": ' + \
        json.dumps(command) + "}}</tool_call>"


# -- the memory planner ---------------------------------------------------------------------------

def run_planned_step(model, plan, prompt_len: int, completion_len: int, group: int = 8) -> tuple[int, int]:
    """Forward and backward of one synthetic group the way ``plan`` says (checkpointing, logits chunk,
    micro-batches); returns (measured peak bytes of the step, the plan's prediction for it)."""
    from localrl.benchmarks.harness import PeakMemory, synthetic_group
    from localrl.memory import ModelShape
    from localrl.policy.shared_prompt import SharedPromptForward, enable_checkpointing

    device = next(model.parameters()).device
    if plan.checkpointing:
        enable_checkpointing(model)
    rollout = synthetic_group(prompt_len, completion_len, group, ModelShape.from_config(model.config).vocab)
    with PeakMemory(device) as mem:
        with SharedPromptForward(model, rollout, chunk_tokens=plan.logits_chunk) as fwd:
            for i in range(0, group, plan.micro_batch):
                fwd.logprobs(slice(i, min(i + plan.micro_batch, group))).sum().backward()
    lora_grads = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    return mem.peak, plan.parts["prompt"] + plan.parts["completion"] + plan.parts["logits"] + lora_grads


def randomise_lora(model):
    """Non-zero LoRA B weights, so gradients reach every adapter weight."""
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2, generator=g)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


# -- a judge behind an OpenAI-compatible endpoint, scripted -------------------------------------------------

class ScriptedJudge:
    """A real HTTP server on a loopback port that answers ``GET /v1/models`` and ``POST /v1/chat/completions`` as an
    OpenAI-compatible judge would, with replies from ``reply(messages) -> str``; ``fail`` (a list of HTTP statuses)
    is answered, one by one, before any reply; ``key``: the bearer key it requires. It keeps every request's
    messages (``requests``) and the Authorization headers it saw. Use as a context manager; ``url`` is its base."""

    MODEL = "scripted-judge"

    def __init__(self, reply, fail: list[int] | None = None, key: str = ""):
        import http.server
        import threading

        self.reply, self.fail, self.key = reply, list(fail or []), key
        self.requests: list[list[dict]] = []
        self.authorizations: list[str] = []
        judge = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorised(self) -> bool:
                judge.authorizations.append(self.headers.get("Authorization", ""))
                if judge.key and self.headers.get("Authorization") != f"Bearer {judge.key}":
                    self._send(401, {"error": {"message": "invalid api key"}})
                    return False
                return True

            def do_GET(self):
                if self._authorised():
                    self._send(200, {"object": "list", "data": [{"id": judge.MODEL, "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if not self._authorised():
                    return
                with judge.lock:
                    status = judge.fail.pop(0) if judge.fail else 200
                    judge.requests.append(body["messages"])
                if status != 200:
                    self._send(status, {"error": {"message": f"scripted failure {status}"}})
                    return
                self._send(200, {"object": "chat.completion", "model": body["model"], "choices": [
                    {"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": judge.reply(body["messages"])}}]})

        self.lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "ScriptedJudge":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def grade_by_reference(messages: list[dict]) -> str:
    """A judge reward's scripted grader: 10 when the graded answer's <answer> tag holds the reference answer."""
    import re

    user = messages[-1]["content"]
    want = re.search(r"Reference answer: (.*)", user).group(1).strip()
    graded = user.split("Answer to grade:\n", 1)[1]
    tags = re.findall(r"<answer>(.*?)</answer>", graded, re.DOTALL)
    return f"Score: {10 if tags and tags[-1].strip() == want else 0}"


HAND_LESSONS = ("Add the two numbers digit by digit from the right, and carry 1 to the next column when a column "
                "sums to 10 or more.", "Give only the final sum inside the answer tags, as digits.")


def write_lessons(messages: list[dict]) -> str:
    """An experience judge's scripted reply: the two hand-written lessons into an empty library, then KEEP."""
    return "\n".join(f"ADD: {lesson}" for lesson in HAND_LESSONS) if "(none yet)" in messages[-1]["content"] \
        else "KEEP"


# -- a live `localrl serve` -------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_environment(**extra: str) -> dict:
    """This process's environment without a developer's own LOCALRL_API_KEY, plus ``extra``."""
    import os

    return {k: v for k, v in os.environ.items() if k != "LOCALRL_API_KEY"} | extra


def serving(gguf, log_dir: Path, *flags, env: dict | None = None):
    """A live ``localrl serve`` of ``gguf`` on a free loopback port (its log in ``log_dir``): yields (its base URL,
    its process) once it answers, and stops it afterwards."""
    import urllib.request

    port = free_port()
    log_path = Path(log_dir) / "server.log"
    log = log_path.open("w")  # a file, not a pipe: a full pipe would stall a server that logs errors
    proc = subprocess.Popen([sys.executable, "-m", "localrl.cli", "serve", str(gguf), "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=env or server_environment())
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 60
    try:
        while True:
            try:
                request = urllib.request.Request(f"{base}/models", headers={"Authorization": "Bearer sekrit"})
                urllib.request.urlopen(request, timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None, log_path.read_text()
                assert time.time() < deadline, "the server did not answer within 60 s:\n" + log_path.read_text()
                time.sleep(0.3)
        yield base, proc
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def write_pairs(path, n: int) -> str:
    """``n`` of the built-in task's pairs as a TRL conversational preference file (JSONL)."""
    import random

    from localrl.data.arithmetic import sample_problems
    from localrl.data.preferences import builtin_pair

    with open(path, "w") as f:
        for p in sample_problems(random.Random(3), n):
            pair = builtin_pair({"prompt": p.question})
            f.write(json.dumps({"prompt": [{"role": "user", "content": pair["prompt"]}],
                                "chosen": [{"role": "assistant", "content": pair["chosen"]}],
                                "rejected": [{"role": "assistant", "content": pair["rejected"]}]}) + "\n")
    return str(path)


def write_demonstrations(path, n: int, conversational: bool = False) -> str:
    """``n`` of the built-in task's problems answered without working (``<answer>N</answer>``, a format the built-in
    model never writes) as a TRL prompt-completion file (JSONL), standard or conversational."""
    import random

    from localrl.data.arithmetic import sample_problems

    with open(path, "w") as f:
        for p in sample_problems(random.Random(5), n):
            prompt, completion = p.question, f"<answer>{p.answer}</answer>"
            if conversational:
                prompt = [{"role": "user", "content": prompt}]
                completion = [{"role": "assistant", "content": completion}]
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return str(path)


def record_sessions(tmp_path, rule: str, n: int = 40):
    """A session log of the scripted person with ``rule`` approving or editing the expert's commands of ``n`` training
    tasks (a scripted model proposes them); its directory."""
    import io
    import random

    from localrl.agent.approvals import Approvals
    from localrl.agent.scripted_person import RULES, ScriptedPerson
    from localrl.agent.session import run_agent
    from localrl.agent.session_log import SessionLog
    from localrl.envs.shell_tasks import sample_tasks

    log = SessionLog(tmp_path / "sessions")
    person = ScriptedPerson(RULES[rule])
    for i, task in enumerate(sample_tasks(random.Random("edits"), n)):
        work = tmp_path / f"w{i}"
        work.mkdir()
        task.setup(work)
        model = ScriptedModel([tool_call(c) for c in task.solution] + ["<answer>done</answer>"])
        run_agent(model, task.instruction, work, person.ask, io.StringIO(), system=None,
                  approvals=Approvals(work, store=tmp_path / "a.json"), log=log)
    return log.directory
