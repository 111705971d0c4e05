"""``localrl export``: a run, model directory or GGUF to a GGUF file for llama.cpp and Ollama, checked in
llama.cpp; with ``--ollama NAME``, made an Ollama model and checked there too (``localrl.serving.ollama``)."""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    """``localrl export``: its flags."""
    p = commands.add_parser("export", help="write a run (adapter merged onto its base) or a model to GGUF, then "
                            "validate it")
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
