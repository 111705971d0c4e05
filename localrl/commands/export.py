"""``localrl export``: a run, model directory or GGUF to a GGUF file for llama.cpp and Ollama, checked in
llama.cpp; with ``--ollama NAME``, made an Ollama model and checked there too (``localrl.serving.ollama``)."""

from __future__ import annotations

import argparse


def cmd_export(args: argparse.Namespace) -> int:
    from localrl.quant.export import export

    if args.ollama:
        from localrl.serving.ollama import check_name

        check_name(args.ollama)  # before minutes of export
    result = export(args.source, args.out, args.quant, check=not args.no_check)
    if result.report is not None:
        print(result.report.describe())
    if result.path is None:
        return 1
    if args.ollama:
        from localrl.serving.ollama import publish

        published = publish(result.path, result.modelfile, args.ollama)
        return 1 if published.created and not published.same else 0
    return 0
