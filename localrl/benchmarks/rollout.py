"""``localrl bench rollout``: generated tokens per second of each rollout backend on the same prompts."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch


def bench_rollout(model: str, prompts: int = 2, group: int = 8, completion_len: int = 128, log=print) -> list[dict]:
    """Generated tokens per second of each rollout backend on the same prompts, measured one after another
    in this process: torch with a 4-bit NF4 base, torch in full precision, llama.cpp batched (an f16 GGUF
    of the same weights). No stop token ends a completion early, so each makes B*G*R tokens; then llama.cpp
    again with the model's stop tokens ending completions (as in training, the tokens it made counted),
    where rows that stop leave the others decoding: its tokens a second should stay near the first's."""
    import tempfile

    from localrl.data import load_task, system_prompt
    from localrl.generation.llama_rollout import LlamaCppSampler
    from localrl.generation.rollout import encode_prompts, sample_groups, stop_token_ids
    from localrl.modeling import load_base, load_config, load_full, load_tokenizer
    from localrl.quant.gguf_writer import write_gguf
    from localrl.quant.runtime import require_llama_cpp

    require_llama_cpp("bench rollout")
    path, config = load_config(model)
    tok = load_tokenizer(path)
    rows = load_task("arith", eval_size=prompts).held_out
    ids = encode_prompts(tok, rows, system_prompt("auto", model))
    device, total = torch.device("cpu"), prompts * group * completion_len
    results = []

    def record(name: str, seconds: float, tokens: int = total) -> None:
        results.append({"backend": name, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds})
        log(f"{name:<34} {seconds:>8.1f} s {tokens / seconds:>9.1f} tokens/s")

    log(f"{'backend':<34} {'time':>10} {'generated':>15}")
    for name, in_4bit in [("torch, 4-bit NF4 base", True), ("torch, full-precision base", False)]:
        policy = load_base(path, in_4bit, device)
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        sample_groups(policy, ids, group, completion_len, [], tok.pad_token_id, 1.0, g)
        record(name, time.perf_counter() - t0)
        del policy
        gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "base-f16.gguf"
        full = load_full(path)
        write_gguf(full.state_dict(), full.config, Path(path), tok, gguf, "f16")
        stops = stop_token_ids(tok, full)
        del full
        sampler = LlamaCppSampler(gguf, prompts * group, max(len(p) for p in ids) + completion_len)
        try:
            t0 = time.perf_counter()
            sampler.sample_groups(ids, group, completion_len, [], 1.0, seed=0)
            record("llama.cpp, batched (f16 GGUF, q8_0 values)", time.perf_counter() - t0)
            t0 = time.perf_counter()
            made = sampler.sample_groups(ids, group, completion_len, stops, 1.0, seed=0).tokens
            record("llama.cpp, rows stopping", time.perf_counter() - t0, sum(map(len, made)))
        finally:
            sampler.close()
    base = results[0]["tokens_per_s"]
    for r in results:
        r["vs_torch_4bit"] = r["tokens_per_s"] / base
    log("ratios to torch 4-bit: " + ", ".join(f"{r['backend']} {r['vs_torch_4bit']:.1f}x" for r in results))
    return results
