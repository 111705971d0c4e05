"""``localrl bench export``: a model written to each GGUF quant type as ``localrl export`` writes it, validated in
llama.cpp: each phase's seconds and each type's agreement with the full-precision model
(localrl.benchmarks.export)."""

from __future__ import annotations

import argparse

from localrl.commands.bench import check_model, json_flag, print_json


def add_parser(benches) -> None:
    p = benches.add_parser("export", help="export to each GGUF quant type, validated in llama.cpp: seconds and "
                           "agreement with the full-precision model")
    p.add_argument("--model", default="tiny-arith", help="the model: a directory, built-in name or run "
                   "(default tiny-arith)")
    p.add_argument("--quant", action="append", metavar="TYPE[,TYPE...]",
                   help="quant types to measure, repeatable or comma-separated (default: all)")
    json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from localrl.benchmarks.export import bench_export, export_quants

    quants = [q.strip() for flag in args.quant for q in flag.split(",") if q.strip()] if args.quant else None
    quants = export_quants(quants)  # unknown names fail here, before anything runs
    which = "every quant type" if args.quant is None else ", ".join(quants)
    check_model(args.model, runs=True)
    print(f"export benchmark: {args.model} to {which}, as localrl export does it (validated in llama.cpp); "
          "seconds per phase; top-1 at all distinct and at decisive positions; logit difference as a "
          "share of the logit range at the median and the worst position")
    rows = bench_export(args.model, quants=quants)
    print_json(args, rows)
    return 0 if all(r["passed"] for r in rows) else 1
