"""The ``localrl`` command line: the parser, and one call per command into ``localrl.commands`` (each command's
checks and output live there). Nothing here a user could not call from Python.

    localrl train [--config FILE.toml] [--resume RUN_DIR] [--FIELD VALUE ...]
    localrl eval [RUN_DIR] [--model M] [--data D] [--eval-size N] [--quantize auto|nf4|none] [--experience RUN] [--reliability F.png]
    localrl models build NAME | localrl models list
    localrl export SOURCE --out FILE.gguf [--quant q8_0] [--no-check] [--ollama NAME]
    localrl serve FILE.gguf [--host H] [--port P] [--api-key-file F] | localrl chat FILE.gguf|RUN_DIR|MODEL [--experience RUN_DIR]
    localrl tui [--attach RUN_DIR] [--model SOURCE] [--workdir DIR]
    localrl baselines pong [--quick] [--agent jepa] [--out DIR] [--steps N] [--seeds N] [--eval-points N] [--workers N]
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

from localrl.commands import analyze, baselines, bench, config_fields, export, main_rank, models, plan, \
    quiet_libraries, serving, steer, train
from localrl.commands import eval as eval_command
from localrl.commands.eval import EVAL_FIELDS
from localrl.config_io import flag_name, split_overrides
from localrl.errors import UserError, out_of_space
from localrl.heap import preload_allocator, return_freed_memory

# commands whose flags include config fields (None: all of them), split from the rest before argparse reads those
FIELD_COMMANDS = {"train": None, "sft": None, "eval": EVAL_FIELDS}
COMMANDS = (train, eval_command, steer, export, serving, analyze, baselines, plan, bench, models)  # each adds its own parsers


def command_fields(command: str, argv: list[str] = ()) -> list[str]:
    """The config fields ``command`` takes as flags (``localrl.commands.config_fields``)."""
    return config_fields(FIELD_COMMANDS[command], argv)


def cmd_tui(args: argparse.Namespace) -> int:
    from localrl.tui.app import run_tui

    return run_tui(args.attach, args.model, args.workdir, args.runs_dir)  # not 0 after an exception it showed


def build_parser() -> argparse.ArgumentParser:
    """The command line: each command's module adds its own parser (``add_parser``); ``localrl tui``'s is here,
    the one command above the commands' layer."""
    parser = _Parser(prog="localrl", description="Local-first GRPO fine-tuning of small reasoning models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    p = sub.add_parser("tui", help="terminal UI: train and watch runs, chat with a model, a terminal agent")
    p.add_argument("--attach", default=None, metavar="RUN_DIR", help="watch a run started elsewhere")
    p.add_argument("--model", default=None, help="chat model to load: FILE.gguf, run directory, model or built-in name")
    p.add_argument("--workdir", default=".", help="the agent's working directory")
    p.add_argument("--runs-dir", default="runs", help="where runs started from the UI go")
    p.set_defaults(func=cmd_tui)
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
        words, sub, siblings = [command], parser.commands[command], {}
        while (nested := next((a for a in sub._actions if isinstance(a, argparse._SubParsersAction)), None)):
            words.append(getattr(args, nested.dest))  # a command of commands (bench NAME): the one named
            sub, siblings = nested.choices[words[-1]], nested.choices
        what = " ".join(words)
        flag = next((a.partition("=")[0] for a in unknown if a.startswith("-")), None)
        if flag is None:
            raise UserError(f"{what}: unexpected argument {unknown[0]!r} (see localrl {what} -h)")
        takers = [name for name, other in siblings.items() if flag in other._option_string_actions]
        if takers:  # a flag of another of the same command's commands (bench export's --quant on bench memory)
            names = ", ".join(takers[:-1]) + " and " * (len(takers) > 1) + takers[-1]
            raise UserError(f"{what}: {flag} is for {' '.join(words[:-1])} {names} (see localrl {what} -h)")
        known = [o for o in sub._option_string_actions if o.startswith("--")]
        known += [flag_name(f) for f in (command_fields(command) if command in FIELD_COMMANDS else [])]
        raise UserError(f"{what}: unknown flag {flag!r}" + _closest(flag, known, f"localrl {what} -h"))
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
