"""NCCLHealthCheck: pre-flight cost with the default probe, and the watchdog's step-time overhead.

    python benchmarks/health/bench.py

2 CPU processes (gloo), GPT demo, DDP, through the real Trainer. Pre-flight: the time NCCLHealthCheck's
setup spends in its checks (barrier, all-reduce check, fingerprints, 16 MiB bandwidth probe); goal <= 3 s.
Overhead: median step time with the health check (watchdog on, stragglers every 100 steps) against none,
interleaved fresh jobs, median of repeats; goal <= 1%.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import gpt_step_time, median, publish, run_worker, worker_parser


def _worker(mode: str, steps: int, warmup: int, out: Path) -> None:
    import lightning.pytorch as pl

    from lightning_mlopt.callbacks import NCCLHealthCheck
    from lightning_mlopt.strategies import DDPStrategy

    class TimedHealth(NCCLHealthCheck):
        def _preflight(self, trainer: pl.Trainer) -> None:
            start = time.perf_counter()
            super()._preflight(trainer)
            self.preflight_seconds = time.perf_counter() - start

    health = TimedHealth() if mode == "health" else None
    step = gpt_step_time(DDPStrategy(), [health] if health else [], steps, warmup)
    if step is not None:
        out.write_text(json.dumps({"median_step_s": step, "preflight_s": getattr(health, "preflight_seconds", None)}))


def main() -> None:
    parser = worker_parser(__doc__, repeats=5, steps=80)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.warmup, args.out)
        return
    steps: dict[str, list[float]] = {"none": [], "health": []}
    preflight: list[float] = []
    for repeat in range(args.repeats):
        for mode in ("none", "health") if repeat % 2 == 0 else ("health", "none"):
            result = run_worker(__file__, mode, args.steps, args.warmup)
            steps[mode].append(result["median_step_s"])
            if result["preflight_s"] is not None:
                preflight.append(result["preflight_s"])
            print(f"repeat {repeat} {mode}: {result}", flush=True)
    overhead = median(steps["health"]) / median(steps["none"]) - 1
    cost = median(preflight)
    body = (
        f"2 CPU processes (gloo), GPT demo, DDP; {args.steps} steps per job, first {args.warmup} excluded, "
        f"median of {args.repeats} interleaved repeats.\n\n"
        "| measure | value | goal |\n|---|---|---|\n"
        f"| pre-flight (barrier, all-reduce check, fingerprints, 16 MiB probe) | {cost:.2f} s | <= 3 s: "
        f"{'met' if cost <= 3 else 'NOT met'} |\n"
        f"| step time without / with NCCLHealthCheck | {median(steps['none']) * 1e3:.2f} / "
        f"{median(steps['health']) * 1e3:.2f} ms | |\n"
        f"| watchdog and straggler overhead | {overhead * 100:+.2f}% | "
        f"<= 1%: {'met' if overhead <= 0.01 else 'NOT met'} |\n"
    )
    publish("health", "cpu-2proc", body)


if __name__ == "__main__":
    main()
