"""``localrl bench distributed``: weak scaling of data-parallel training, whole ``localrl train`` runs under
torchrun."""

from __future__ import annotations

import statistics
from pathlib import Path

from localrl.errors import UserError


def bench_distributed(model: str = "tiny-arith", prompts: int = 8, group: int = 8, max_new_tokens: int = 32,
                      steps: int = 3, log=print) -> dict:
    """Weak scaling of data-parallel training on this machine: whole ``localrl train`` runs launched by torchrun
    (gloo), one process and then two ranks, each rank with the same work a step (``prompts`` x ``group``
    completions) and one CPU thread. Efficiency = the one process's step time / the two ranks' step time
    (1.0: twice the batch in the same time); the all-reduce share = the LoRA-gradient all-reduce's seconds /
    the step's. Medians over ``steps`` steps after a warm-up step; the step time of two ranks is the slower
    rank's, the all-reduce's the faster rank's (the slower one's includes its wait for the other)."""
    import subprocess
    import sys
    import tempfile

    from localrl.metrics import read_metrics
    from localrl.runs import Run

    def launch(nproc: int, run_dir: Path) -> list[dict]:
        fields = {"model": model, "steps": steps + 1, "prompts-per-step": prompts, "group-size": group,
                  "max-new-tokens": max_new_tokens, "eval-size": 0, "threads": 1, "rollout": "torch",
                  "save-every": steps + 1, "run-dir": run_dir}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   "-m", "localrl", "train", *(x for k, v in fields.items() for x in (f"--{k}", str(v)))]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["(no output)"]
            raise UserError(f"bench distributed: the {nproc}-process run failed: {tail[0]}")
        return [r for r in read_metrics(Run(run_dir).metrics_path) if r["kind"] == "train"][1:]

    log(f"{'processes':<10} {'global batch':>14} {'step':>9} {'all-reduce':>12} {'share':>7} {'completion':>11}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in (1, 2):
            records = launch(nproc, Path(tmp) / f"run-{nproc}")
            step_s = statistics.median(r["step_s"] for r in records)
            allreduce_s = statistics.median(r.get("allreduce_s", 0.0) for r in records)
            length = statistics.mean(r["completion_len"] for r in records)
            rows.append({"processes": nproc, "completions": prompts * group * nproc, "step_s": step_s,
                         "allreduce_s": allreduce_s, "allreduce_share": allreduce_s / step_s,
                         "completion_len": length})
            log(f"{nproc:<10} {prompts * nproc:>5} x {group:<6} {step_s:>7.3f} s {allreduce_s * 1000:>9.2f} ms "
                f"{100 * allreduce_s / step_s:>6.2f}% {length:>7.1f} tok")
    efficiency = rows[0]["step_s"] / rows[1]["step_s"]
    log(f"weak-scaling efficiency, 2 processes: {efficiency:.2f} (completions a second: "
        f"{rows[0]['completions'] / rows[0]['step_s']:.1f} -> {rows[1]['completions'] / rows[1]['step_s']:.1f}); "
        f"all-reduce {100 * rows[1]['allreduce_share']:.2f}% of the 2-process step")
    return {"rows": rows, "efficiency": efficiency}
