"""``localrl serve``, ``localrl chat`` and ``localrl agent``: working with a model once it is trained."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import fields
from pathlib import Path

from localrl.commands import quiet_libraries
from localrl.errors import UserError
from localrl.serving.limits import RequestLimits


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
