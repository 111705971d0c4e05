"""``localrl bench export``: a model (the built-in one by default) exported to each quant type as ``localrl export``
does it; each phase's time (load, write, f16 validation, llama.cpp's quantisation, validation) beside the llama.cpp
validation figures."""

from __future__ import annotations

from pathlib import Path

from localrl.errors import UserError


def export_quants(quants: list[str] | None = None) -> list[str]:
    """The quant types ``bench export`` measures: ``quants`` checked against the known ones, or all of them."""
    from localrl.quant.export import EXPORT_TYPES

    known = list(EXPORT_TYPES)
    if quants is None:
        return known
    unknown = [q for q in quants if q not in known]
    if unknown or not quants:
        raise UserError(f"bench export: unknown quant type(s) {', '.join(unknown) or '(none given)'}; "
                        f"known: {', '.join(known)}")
    return list(quants)


EXPORT_PHASES = ("load", "write", "validate f16", "quantise", "validate")


def bench_export(source: str = "tiny-arith", quants: list[str] | None = None, log=print) -> list[dict]:
    """Export ``source`` to each of ``quants`` (default: every quant type) as ``localrl export`` does, validation
    included; each phase's time, the file size and the llama.cpp validation figures of each."""
    import tempfile

    from localrl.quant.export import export

    quants = export_quants(quants)
    rows = []
    log(f"{'type':<7} {'load s':>6} {'write s':>7} {'f16 check s':>11} {'quantise s':>10} {'check s':>7} "
        f"{'total s':>7} {'peak GiB':>8} {'MiB':>7} | {'tokens':>6} {'top-1':>6} {'decisive':>8} {'KL':>8} {'median':>7} "
        f"{'worst':>7} {'greedy':>6} | result")
    with tempfile.TemporaryDirectory() as tmp:
        for quant in quants:
            out = Path(tmp) / f"{quant}.gguf"
            result = export(source, out, quant, log=lambda *_: None)
            r = result.report
            row = {"quant": quant, "seconds": {p: result.seconds.get(p, 0.0) for p in EXPORT_PHASES},
                   "export_s": sum(result.seconds.values()),
                   "peak_gib": {p: result.peaks[p] / 2**30 for p in EXPORT_PHASES if p in result.peaks},
                   "bytes": out.stat().st_size if result.path else None,
                   "tokens_identical": r.tokens_identical, "top1": r.top1_agreement,
                   "decisive_top1": r.decisive_agreement, "decisive_positions": r.decisive_positions,
                   "kl_mean": r.kl_mean, "max_abs_logit_diff": r.max_abs_logit_diff,
                   "median_rel_logit_error": r.median_rel_logit_error, "rel_logit_error": r.rel_logit_error,
                   "greedy_identical": r.greedy_identical, "passed": r.passed}
            rows.append(row)
            t = row["seconds"]
            size = f"{row['bytes'] / 2**20:>7.1f}" if row["bytes"] else f"{'-':>7}"
            log(f"{quant:<7} {t['load']:>6.1f} {t['write']:>7.1f} {t['validate f16']:>11.1f} {t['quantise']:>10.1f} "
                f"{t['validate']:>7.1f} {row['export_s']:>7.1f} {max(row['peak_gib'].values(), default=0):>8.2f} "
                f"{size} | "
                f"{'same' if r.tokens_identical else 'DIFF':>6} {r.top1_agreement:>6.1%} {r.decisive_agreement:>8.1%} "
                f"{r.kl_mean:>8.5f} {r.median_rel_logit_error:>7.2%} {r.rel_logit_error:>7.2%} "
                f"{'same' if r.greedy_identical else 'diff':>6} | {'pass' if r.passed else 'FAIL'}")
    return rows
