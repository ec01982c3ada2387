"""The pipeline bubble, measured against the schedule's theory, for 2, 4 and 8 micro-batches.

    python benchmarks/pipeline/bubble.py                      # gpipe, 1f1b, interleaved_1f1b x m = 2, 4, 8
    python benchmarks/pipeline/bubble.py --schedules 1f1b --microbatches 4,8 --steps 20 --no-publish

Each cell is one 2-process job on CPU (gloo) of what a user runs: ``python -m lightning_mlopt fit --config
configs/gpt.yaml --config configs/strategies/pp.yaml`` with its default callbacks, the schedule and the number of
micro-batches set on the command line (``interleaved_1f1b`` cuts the demo's 4 layers into 4 stages, 2 per rank).
PerformanceMonitor's ``summary.json`` gives each rank's idle share of its schedule's steps (the first batch
left out) and the step time. The baseline, computed in the same run, is the schedule's theoretical bubble with
equal stages and free communication: ``(p - 1) / (m + p - 1)``, or ``(p - 1) / (v m + p - 1)`` with ``v`` stages per
rank; the ratio says how much communication and unequal stages add on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from _common import publish, run_fresh_job  # noqa: E402

SPLITS = {"interleaved_1f1b": "[model.layers.1, model.layers.2, model.layers.3]"}


def _job(schedule: str, microbatches: int, steps: int, work: Path) -> dict[str, float]:
    """One fit; its run's pipeline figures from PerformanceMonitor's summary."""
    command = [
        *[sys.executable, "-m", "lightning_mlopt", "fit", "--config", str(REPO / "configs" / "gpt.yaml")],
        *["--config", str(REPO / "configs" / "strategies" / "pp.yaml")],
        *["--trainer.accelerator=cpu", "--trainer.devices=2", f"--trainer.max_steps={steps}"],
        *["--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", f"--run_dir={work / 'run'}"],
        f"--trainer.strategy.init_args.schedule={schedule}",
        f"--trainer.strategy.init_args.microbatches={microbatches}",
    ]
    if schedule in SPLITS:
        command.append(f"--trainer.strategy.init_args.split_points={SPLITS[schedule]}")
    run_fresh_job(command, work, f"{schedule} m={microbatches}")
    summary = json.loads((work / "run" / "perf" / "summary.json").read_text())
    metrics = summary["metrics"]
    ranks = [rank["pipeline_idle"] / rank["pipeline_steps"] for rank in summary["ranks"]]
    return {
        "theory": metrics["perf/pipeline_bubble_theory"],
        "measured": metrics["perf/pipeline_bubble"],
        "rank0": ranks[0],
        "rank1": ranks[1],
        "step_ms": 1e3 * metrics["perf/step_time_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-publish", action="store_true", help="print the table; write no result file")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pp-bubble-") as scratch:
        for schedule in args.schedules.split(","):
            for m in (int(value) for value in args.microbatches.split(",")):
                work = Path(scratch) / f"{schedule}-{m}"
                work.mkdir()
                figures = _job(schedule, m, args.steps, work)
                print(f"{schedule} m={m}: {figures}", flush=True)
                rows.append((schedule, m, figures))
    lines = [
        "| schedule | micro-batches | theory (baseline) | measured (mean of ranks) | rank 0 | rank 1 "
        "| measured / theory | step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for schedule, m, f in rows:
        ratio = f["measured"] / f["theory"] if f["theory"] else float("nan")
        lines.append(
            f"| {schedule} | {m} | {f['theory']:.1%} | {f['measured']:.1%} | {f['rank0']:.1%} | {f['rank1']:.1%} "
            f"| {ratio:.2f} | {f['step_ms']:.0f} |"
        )
    body = (
        f"The GPT demo (4 layers) under `configs/strategies/pp.yaml` through the CLI with its default callbacks, "
        f"2 CPU processes (gloo), {args.steps} steps per job, one job per cell. Measured: PerformanceMonitor's "
        "`perf/pipeline_bubble` over the run (each rank's time in its schedule's steps outside its stages' "
        "forward and backward, the first batch left out). Theory: the schedule's bubble with equal stages and "
        "free communication, `(p-1)/(v m+p-1)`.\n\n" + "\n".join(lines)
    )
    if args.no_publish:
        print(body)
    else:
        publish("pp_bubble", "cpu-2proc", body)


if __name__ == "__main__":
    main()
