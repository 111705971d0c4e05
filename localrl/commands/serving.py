"""``localrl serve``, ``localrl chat`` and ``localrl agent``: working with a model once it is trained."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import fields
from pathlib import Path

from localrl.commands import quiet_libraries
from localrl.config_io import flag_name
from localrl.errors import UserError
from localrl.serving.limits import RequestLimits


def add_parser(commands) -> None:
    """``localrl serve``, ``localrl chat`` and ``localrl agent``: their flags."""
    p = commands.add_parser("serve", help="serve a GGUF over an OpenAI-compatible HTTP API (llama-cpp-python)")
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
    for f in fields(RequestLimits):  # what one request may make the server parse (localrl.serving.limits)
        p.add_argument(flag_name(f.name), type=type(f.default), default=f.default,
                       help=f"{RequestLimits.HELP[f.name]} (default {f.default})")
    p.set_defaults(func=cmd_serve)

    p = commands.add_parser("chat", help="streaming terminal chat with a GGUF, a run or a model")
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

    p = commands.add_parser("agent", help="one task for an agent (a run, GGUF or model) in a directory; you approve "
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


def cmd_serve(args: argparse.Namespace) -> int:
    from localrl.serving.gate import api_key_from
    from localrl.serving.serve import serve

    key = api_key_from(args.api_key, args.api_key_file, warn=lambda line: print(f"localrl: {line}", file=sys.stderr))
    if args.api_key is not None:
        print("localrl: warning: --api-key is visible to other users in the process list; prefer --api-key-file "
              "PATH or the LOCALRL_API_KEY environment variable", file=sys.stderr)
    limits = RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)})
    serve(args.gguf, args.host, args.port, key, args.n_ctx, max_body_bytes=args.max_body_bytes,
          cors_origins=tuple(args.cors_origin), allowed_hosts=tuple(args.allowed_host), insecure=args.insecure,
          limits=limits)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from localrl.serving.chat import terminal_chat

    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"chat --temperature: must be a finite number, 0 (greedy) or more (got {args.temperature})")
    if args.n_ctx < 0 or args.max_tokens < 1:
        raise UserError("chat: --n-ctx must be 0 (the model's training context) or more, --max-tokens at least 1")

    system = args.system
    if args.experience:  # a training-free GRPO run's lessons, after the system message
        from localrl.policy.experience import load_library

        system = load_library(args.experience).system(system)
    source = args.source or args.experience
    if source is None:
        raise UserError("chat: name a model (FILE.gguf, run directory, model) or --experience RUN_DIR")
    terminal_chat(source, args.n_ctx, args.max_tokens, system, args.temperature)
    return 0


def record_directory(setting: str, source: str) -> Path:
    """Where ``--record`` keeps sessions: its DIR, or (given without one) the run's ``sessions/`` folder."""
    from localrl.runs import Run

    if setting != "auto":
        return Path(setting)
    if Path(source).is_dir() and Run(source).config_path.is_file():
        return Path(source) / "sessions"
    raise UserError(f"agent --record: {source} is not a run; name the directory to record in (--record DIR)")


def cmd_agent(args: argparse.Namespace) -> int:
    from localrl.agent.session import agent_system, check_workdir, run_agent, terminal_ask, terminal_rating
    from localrl.agent.session_log import SessionLog
    from localrl.serving.chat import open_chat_model

    check_workdir(args.workdir, args.force_workdir)
    if args.max_turns < 1 or args.max_tokens < 1 or not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UserError(f"agent: --max-turns, --max-tokens and --timeout must be positive numbers (got --timeout "
                        f"{args.timeout})")
    system = agent_system(args.system, args.source)
    log = SessionLog(record_directory(args.record, args.source)) if args.record else None
    if log is not None:
        log.check()  # before the episode, not after it
    revise = None
    if args.follow_edits:
        from localrl.agent.edit_rules import EditRules

        rules = EditRules.from_sessions(args.follow_edits)
        print(f"following your edits in {args.follow_edits}: {rules.describe()}" + "".join(
            f"\n  {r.describe()}" for r in rules.rules))
        revise = rules.apply
    quiet_libraries()
    model = open_chat_model(args.source, args.n_ctx)
    try:
        run_agent(model, args.task, args.workdir, terminal_ask(), max_turns=args.max_turns, max_tokens=args.max_tokens,
                  timeout=args.timeout, system=system, force_workdir=args.force_workdir, log=log,
                  rate=terminal_rating() if log is not None else None, revise=revise)
    finally:
        model.close()
    return 0
