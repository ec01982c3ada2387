"""PerformanceMonitor: step-time overhead on the GPT demo, 2 CPU processes (DDP, gloo), logging every step and
every 50 steps, measured in the same job as its baseline.

    python benchmarks/perf_monitor/bench.py

Each job trains with the monitor active on alternate steps: its phase markers, clock, sample counting and,
on logging steps, the window's sum over ranks, the metrics and the stall check. With and without alternate
in the same processes, so drift cancels. Logging every step with the monitor alone, they alternate in blocks
of 20 steps instead: the background sum started at a logging step runs during the next step, which must be a
monitored one to be charged (only a block's last sum spills over). "Every step" logs on every active step;
"every 50" logs every 25 active steps, i.e. every 50 steps of the job, its cost amortised over the active
steps only (twice what it costs a job monitored throughout: conservative). The matmul probe and the FLOP
count run at the start and are left out with the warm-up steps. Goals: <= 2% and <= 0.5%.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import gpt_step_gaps, interleaved_jobs, overhead_table, publish, worker_parser

# logging period (and "+ftc": FaultTolerantCheckpoint in both arms, as in every CLI run) -> goal
MODES = {"1": 0.02, "50": 0.005, "1+ftc": 0.02, "50+ftc": 0.005}


def _block(mode: str) -> int:
    """Steps with, then as many without: one by one (drift cancels best), except for the background sum."""
    return 20 if mode == "1" else 1


def _active(step: int, block: int) -> bool:
    return (step // block) % 2 == 1


def _worker(mode: str, steps: int, warmup: int, out: Path) -> None:
    from lightning_mlopt.callbacks import PerformanceMonitor
    from lightning_mlopt.strategies import DDPStrategy

    class ToggledMonitor(PerformanceMonitor):
        """The monitor, active in alternate blocks of steps, so one job measures with and without it."""

        active = False

        def on_train_batch_start(self, trainer, *args):  # type: ignore[no-untyped-def, override]
            self.active = _active(trainer.global_step, block)
            if self.active:
                super().on_train_batch_start(trainer, *args)

        def on_before_backward(self, *args):  # type: ignore[no-untyped-def, override]
            if self.active:
                super().on_before_backward(*args)

        def on_before_optimizer_step(self, *args):  # type: ignore[no-untyped-def, override]
            if self.active:
                super().on_before_optimizer_step(*args)

        def on_train_batch_end(self, *args):  # type: ignore[no-untyped-def, override]
            if self.active:
                super().on_train_batch_end(*args)

    block = _block(mode)
    period = int(mode.removesuffix("+ftc"))
    every = 1 if period == 1 else period // 2  # in active steps
    callbacks: list[object] = [ToggledMonitor(log_every_n_steps=every)]
    if mode.endswith("+ftc"):
        import tempfile

        from lightning_mlopt.callbacks import FaultTolerantCheckpoint, SaveOn

        # Votes every step (signals, timers, failed writes); saves nothing here.
        folder = tempfile.mkdtemp(prefix="perf_bench_")
        callbacks.append(FaultTolerantCheckpoint(dirpath=folder, save_on=SaveOn(epoch_end=False, train_end=False)))
    # The timer after the monitor: the monitor's batch-end work (its logging steps) counts in its own step.
    gaps = gpt_step_gaps(DDPStrategy(), callbacks, steps, timer_last=True)
    if gaps is not None:
        kept = [(step, t) for step, t in gaps if step >= warmup]
        typical = statistics.median(t for _, t in kept)
        kept = [(step, t) for step, t in kept if t < 3 * typical]  # an OS hiccup, not the monitor
        on = [t for step, t in kept if _active(step, block)]
        off = [t for step, t in kept if not _active(step, block)]
        out.write_text(json.dumps({"on_s": statistics.mean(on), "off_s": statistics.mean(off), "steps": len(gaps)}))


def main() -> None:
    parser = worker_parser(__doc__, repeats=5, steps=310)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.warmup, args.out)
        return
    runs = interleaved_jobs(__file__, list(MODES), args.repeats, args.steps, args.warmup)
    labels = {mode: f"every {mode.replace('+ftc', ', with FaultTolerantCheckpoint')}" for mode in MODES}
    table = overhead_table(runs, MODES, labels)
    body = (
        "## Step-time overhead of PerformanceMonitor, GPT demo, 2 CPU processes (DDP, gloo)\n\n"
        f"Each job trains {args.steps} steps with the monitor active on alternate steps, or, logging every step "
        "alone, in alternate blocks of 20 steps (its background sum runs during the next step, which must be a "
        "monitored one; only a block's last spills over). The baseline is measured in the same processes, so "
        f"drift cancels; first {args.warmup} "
        "steps excluded; mean step time with and without it (logging steps included, amortised; steps over "
        f"3x the median dropped as OS hiccups); median of {args.repeats} jobs. No logger is attached: what is "
        "measured is the monitor's own work, not a logger's write.\n\n"
        "| monitor logging | step without (ms) | step with (ms) | overhead | goal |\n|---|---|---|---|---|\n"
        + table
        + "\n\n"
        "Every step the monitor marks four phase changes (a clock read each on CPU; a CUDA event each on a "
        "GPU, never waited for) and counts the batch's samples from its shape. A logging step reads the clock "
        "(on a GPU: the one synchronisation, on the newest event) and the peak memory, and submits its "
        "13-number window: it rides in the next step exchange another callback makes (FaultTolerantCheckpoint's "
        "vote: no collective added), or else is summed in the background on a gloo group of its own, whose "
        "thread competes with training for this machine's 2 cores. The sums are read a batch later; the "
        "metrics and the stall check run on the host.\n"
    )
    publish("perf_monitor", "cpu-2proc", body)


if __name__ == "__main__":
    main()
