"""ReplicaConsistencyCheck: (a) the cost of one check per million parameters; (b) its step-time overhead at
every 100 steps on the GPT demo, 2 CPU processes (DDP, gloo), measured in the same job.

    python benchmarks/replica_check/bench.py

(a) One process: fingerprinting every parameter and Adam moment of GPT models of growing width (what a DDP
check hashes), median of 7 repeats of 5 checks; ms per million tensor elements.
(b) 2-process jobs that check every 10 steps (so one job holds many checks); a check step's extra time is its
wall time minus the median of the neighbouring steps that did not check; overhead at every 100 steps =
median extra time / (100 x median step time). Goal: <= 1%.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import gpt_step_gaps, median, publish, run_worker, worker_parser

EVERY = 10


def _part_a() -> str:
    import torch

    from lightning_mlopt.demos import GPTLanguageModel
    from lightning_mlopt.diagnosis.bit_hash import bit_hashes

    rows = []
    for d_model in (128, 256, 512):
        model = GPTLanguageModel(n_layer=4, d_model=d_model, n_head=4)
        tensors = [p.detach() for p in model.parameters()]
        tensors += [torch.randn_like(t) for t in tensors for _ in range(2)]  # Adam's two moments
        elements = sum(t.numel() for t in tensors)
        bit_hashes(tensors, torch.device("cpu"))  # warm-up
        runs = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(5):
                bit_hashes(tensors, torch.device("cpu")).tolist()
            runs.append((time.perf_counter() - start) / 5)
        seconds = median(runs)
        rows.append(
            f"| {d_model} | {len(tensors)} | {elements / 1e6:.2f} | {seconds * 1e3:.2f} | "
            f"{seconds * 1e3 / (elements / 1e6):.2f} |"
        )
    return (
        "## (a) One check's fingerprints, CPU, 1 process\n\n"
        "GPT demo (4 blocks) at three widths: every parameter and two Adam moments per parameter, as a DDP check "
        "hashes them; median of 7 repeats of 5 checks.\n\n"
        "| d_model | tensors | elements (M) | ms per check | ms per million elements |\n|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n"
    )


def _worker(steps: int, warmup: int, out: Path) -> None:
    from lightning_mlopt.callbacks import ReplicaConsistencyCheck
    from lightning_mlopt.strategies import DDPStrategy

    gaps = gpt_step_gaps(DDPStrategy(), [ReplicaConsistencyCheck(every_n_steps=EVERY)], steps, timer_last=True)
    if gaps is None:
        return
    times = dict(gaps)  # a step's wall time, keyed by the global step it started at
    extras, plain = [], []
    for step, seconds in gaps:
        if step < warmup:
            continue
        # Step `step` ends at global step `step + 1`; the check runs at its end when that is a multiple.
        if (step + 1) % EVERY == 0:
            neighbours = [times[s] for s in (step - 2, step - 1, step + 1, step + 2) if s in times]
            extras.append(seconds - statistics.median(neighbours))
        else:
            plain.append(seconds)
    out.write_text(json.dumps({"extra_s": statistics.median(extras), "step_s": statistics.median(plain)}))


def main() -> None:
    parser = worker_parser(__doc__, repeats=5, steps=210, warmup=10)
    parser.add_argument("--part", choices=["a", "b", "all"], default="all")
    args = parser.parse_args()
    if args.worker:
        _worker(args.steps, args.warmup, args.out)
        return
    body = _part_a() if args.part in ("a", "all") else ""
    if args.part in ("b", "all"):
        runs = [run_worker(__file__, "check", args.steps, args.warmup) for _ in range(args.repeats)]
        extra = median([r["extra_s"] for r in runs])
        step = median([r["step_s"] for r in runs])
        overhead = extra / (100 * step)
        body += (
            "## (b) Step-time overhead at every 100 steps, GPT demo (0.9M parameters), 2 CPU processes (DDP)\n\n"
            f"Jobs of {args.steps} steps checking every {EVERY} steps; a check step's extra time against the median "
            f"of its neighbours; median of {args.repeats} jobs.\n\n"
            "| one check (ms) | step (ms) | overhead at every 100 steps | goal |\n|---|---|---|---|\n"
            f"| {extra * 1e3:.2f} | {step * 1e3:.2f} | {overhead * 100:.3f}% | <= 1%: "
            f"{'met' if overhead <= 0.01 else 'NOT met'} |\n\n"
            "Per job (ms per check): " + ", ".join(f"{r['extra_s'] * 1e3:.2f}" for r in runs) + ".\n\n"
            "A check: fingerprints on the device (two integer sums per tensor, no copy to the host), one "
            "all-gather of 2 int64 per tensor, one host read.\n"
        )
    publish("replica_check", "cpu-2proc", body)


if __name__ == "__main__":
    main()
