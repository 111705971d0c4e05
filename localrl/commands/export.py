"""``localrl export``: a run, model directory or GGUF to a GGUF file for llama.cpp and Ollama, checked in
llama.cpp."""

from __future__ import annotations

import argparse


def cmd_export(args: argparse.Namespace) -> int:
    from localrl.quant.export import export

    result = export(args.source, args.out, args.quant, check=not args.no_check)
    if result.report is not None:
        print(result.report.describe())
    return 0 if result.path is not None else 1
