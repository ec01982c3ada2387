"""GoodputLedger: its per-step cost against the step time of the same run, GPT demo, 2 CPU processes (DDP, gloo).

    python benchmarks/goodput/bench.py

Two measurements in each job, with FaultTolerantCheckpoint in both arms as in every CLI run:

1. **Its own time, measured directly**: every call into the ledger's code on a step (its phase listener, its
   batch-end hook, the record's copy into the mapped file) is timed with ``perf_counter`` on rank zero (the
   only rank that writes), summed per step, and divided by the mean step time of the same steps. The timer's
   own two clock reads per call are included: an upper bound.
2. **With and without, interleaved**: the ledger is active in alternate blocks of 20 steps (its record is
   written at the next batch's fetch, so one step by one would charge it to the other arm; only a block's last
   record spills over), and the mean step time of each arm is compared. On a shared 2-core machine this
   difference is noise of several percent, far above the goal: it shows there is no hidden cost (a sync, a stall)
   that the direct timing would miss.

Goal: < 0.1% of the step time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import gpt_step_gaps, interleaved_jobs, median, publish, worker_parser

BLOCK = 20
GOAL = 0.001


def _active(step: int) -> bool:
    return (step // BLOCK) % 2 == 1


def _worker(steps: int, warmup: int, out: Path) -> None:
    import tempfile

    from lightning_mlopt.callbacks import FaultTolerantCheckpoint, SaveOn
    from lightning_mlopt.callbacks.phase_markers import PhaseMarkers
    from lightning_mlopt.goodput.ledger import GoodputLedger
    from lightning_mlopt.strategies import DDPStrategy

    spent: dict[int, float] = {}  # global step -> seconds inside the ledger's code

    class ToggledLedger(GoodputLedger):
        """The ledger, active in alternate blocks of steps, timing its own work; the phase marks always run
        (in the CLI PerformanceMonitor marks them anyway)."""

        active = False
        step = 0

        def on_train_batch_start(self, trainer, *args):  # type: ignore[no-untyped-def, override]
            self.step = trainer.global_step
            self.active = _active(self.step)
            super().on_train_batch_start(trainer, *args)

        def switch(self, ended: str) -> None:
            if self.active:
                started = time.perf_counter()
                super().switch(ended)
                spent[self.step] = spent.get(self.step, 0.0) + time.perf_counter() - started

        def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def, override]
            if not self.active:
                PhaseMarkers.on_train_batch_end(self, trainer, *args)
                return
            started = time.perf_counter()
            super().on_train_batch_end(trainer, *args)
            spent[self.step] = spent.get(self.step, 0.0) + time.perf_counter() - started

    folder = tempfile.mkdtemp(prefix="goodput_bench_")
    ledger = ToggledLedger(path=f"{folder}/goodput.jsonl", log_goodput=False)
    checkpoint = FaultTolerantCheckpoint(dirpath=folder, save_on=SaveOn(epoch_end=False, train_end=False))
    # The timer after the ledger: the ledger's batch-end work counts in its own step.
    gaps = gpt_step_gaps(DDPStrategy(), [ledger, checkpoint], steps, timer_last=True)
    if gaps is None:
        return
    kept = [(step, t) for step, t in gaps if step >= warmup]
    typical = statistics.median(t for _, t in kept)
    kept = [(step, t) for step, t in kept if t < 3 * typical]  # an OS hiccup, not the ledger
    on = [t for step, t in kept if _active(step)]
    off = [t for step, t in kept if not _active(step)]
    own = [spent.get(step, 0.0) for step, _ in kept if _active(step)]
    lines = Path(ledger.path or "").read_text().splitlines()
    steps_recorded = sum('"event":"step"' in line for line in lines)
    out.write_text(
        json.dumps(
            {
                "on_s": statistics.mean(on),
                "off_s": statistics.mean(off),
                "own_s": statistics.mean(own),
                "bytes_per_record": sum(len(line) + 1 for line in lines if '"event":"step"' in line)
                / max(steps_recorded, 1),
            }
        )
    )


def main() -> None:
    parser = worker_parser(__doc__, repeats=5, steps=330, warmup=10, workers=["ledger"])
    args = parser.parse_args()
    if args.worker:
        _worker(args.steps, args.warmup, args.out)
        return
    runs = interleaved_jobs(__file__, ["ledger"], args.repeats, args.steps, args.warmup)["ledger"]
    own = [run["own_s"] / run["on_s"] for run in runs]
    interleaved = [run["on_s"] / run["off_s"] - 1 for run in runs]
    step_ms = median([run["on_s"] for run in runs]) * 1e3
    own_us = median([run["own_s"] for run in runs]) * 1e6
    body = (
        "## Per-step cost of GoodputLedger, GPT demo (4 layers, d_model 128), 2 CPU processes (DDP, gloo)\n\n"
        f"Each job trains {args.steps} steps with FaultTolerantCheckpoint (its per-step vote; no saves) and the "
        f"ledger active in alternate blocks of {BLOCK} steps; first {args.warmup} steps excluded, steps over 3x "
        f"the median dropped as OS hiccups; median of {args.repeats} jobs.\n\n"
        "| measure | value | goal |\n|---|---|---|\n"
        f"| step time (ms) | {step_ms:.2f} | |\n"
        f"| ledger's own time per step, timed directly on rank zero (us) | {own_us:.1f} | |\n"
        f"| **ledger's own time / step time** | **{median(own) * 100:.4f}%** | < {GOAL * 100:g}%: "
        f"{'met' if median(own) < GOAL else 'NOT met'} |\n"
        f"| step time with / without, interleaved in the same job | {median(interleaved) * 100:+.2f}% | "
        "noise bound (see below) |\n"
        f"| bytes per step record | {median([run['bytes_per_record'] for run in runs]):.0f} | |\n\n"
        "Per job, own time / step time: "
        + ", ".join(f"{value * 100:.4f}%" for value in own)
        + "; with / without: "
        + ", ".join(f"{value * 100:+.2f}%" for value in interleaved)
        + ".\n\n"
        "What a step costs the ledger: on rank zero, its batch-end hook (the phase mark, the step number, one "
        "attribute read of the preemption flag), one call where the next batch's fetch begins (a copy of the "
        "process's seconds per phase, which the phase markers keep), and a copy of one JSON line into a shared "
        "mapping of the file: no system call (an `os.write` per step measured 70 us median here, the scheduler "
        "taking the CPU at the call: about 0.1% on its own), no fsync (only at the launch's start, commits, end "
        "and exit). The other "
        "ranks only mark phases, which PerformanceMonitor does anyway in every CLI run. The interleaved "
        "comparison cannot resolve 0.1% on this shared 2-core machine (single jobs spread by several percent); "
        "it is there to show no hidden cost (a sync, a stall) that the direct timing would miss.\n"
    )
    publish("goodput", "cpu-2proc", body)


if __name__ == "__main__":
    main()
