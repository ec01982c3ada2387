"""NCCLHealthCheck: pre-flight cost with the default probe, and the watchdog's step-time overhead.

    python benchmarks/health/bench.py

2 CPU processes (gloo), GPT demo, DDP, through the real Trainer. Pre-flight: the time NCCLHealthCheck's
setup spends in its checks (barrier, all-reduce check, fingerprints, 16 MiB bandwidth probe); goal <= 3 s.
Overhead: median step time with the health check (watchdog on, stragglers every 100 steps) against none,
interleaved fresh jobs, median of repeats; goal <= 1%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import median, write_result


def _worker(mode: str, steps: int, warmup: int, out: Path) -> None:
    import lightning.pytorch as pl

    from lightning_mlopt.callbacks import NCCLHealthCheck
    from lightning_mlopt.demos import GPTLanguageModel, TokenDataModule
    from lightning_mlopt.strategies import DDPStrategy

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args: object) -> None:
            self.ends.append(time.perf_counter())

    class TimedHealth(NCCLHealthCheck):
        def _preflight(self, trainer: pl.Trainer) -> None:
            start = time.perf_counter()
            super()._preflight(trainer)
            self.preflight_seconds = time.perf_counter() - start

    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    health = TimedHealth() if mode == "health" else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, *([health] if health else [])],
    )
    trainer.fit(GPTLanguageModel(), TokenDataModule(num_sequences=steps * 32, batch_size=16))
    if trainer.is_global_zero:
        gaps = [b - a for a, b in zip(timer.ends[warmup:], timer.ends[warmup + 1 :], strict=False)]
        result = {"median_step_s": median(gaps), "preflight_s": getattr(health, "preflight_seconds", None)}
        out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--worker")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.warmup, args.out)
        return
    steps: dict[str, list[float]] = {"none": [], "health": []}
    preflight: list[float] = []
    for repeat in range(args.repeats):
        for mode in ("none", "health") if repeat % 2 == 0 else ("health", "none"):
            out = Path(f"/tmp/health_bench_{os.getpid()}_{mode}.json")
            command = [
                sys.executable,
                __file__,
                "--worker",
                mode,
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
            ]
            subprocess.run(
                [*command, "--out", str(out)],
                check=True,
                capture_output=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            result = json.loads(out.read_text())
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
    path = write_result("health", "cpu-2proc", body)
    print(body)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
