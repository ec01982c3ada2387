"""Step time of our DDPStrategy against Lightning's built-in DDP on the GPT demo, 2 CPU processes.

    python benchmarks/ddp/bench.py                 # 5 alternating repeats, writes benchmarks/results/
    python benchmarks/ddp/bench.py --repeats 3 --steps 40

Each repeat runs both strategies (alternating which goes first) in fresh 2-process jobs through the real
Trainer; a run's figure is the median step time after warm-up; the result is the median over repeats and
the ratio ours / Lightning's. Goal: ratio <= 1.02.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import gpt_step_time, median, publish, run_worker, worker_parser


def _worker(strategy_name: str, steps: int, warmup: int, out: Path) -> None:
    from lightning_mlopt.strategies import DDPStrategy

    step = gpt_step_time(DDPStrategy() if strategy_name == "ours" else "ddp", steps=steps, warmup=warmup)
    if step is not None:
        out.write_text(json.dumps({"median_step_s": step}))


def main() -> None:
    parser = worker_parser(__doc__, repeats=5, steps=60, workers=["ours", "lightning"])
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.warmup, args.out)
        return
    times: dict[str, list[float]] = {"lightning": [], "ours": []}
    for repeat in range(args.repeats):
        order = ["lightning", "ours"] if repeat % 2 == 0 else ["ours", "lightning"]
        for name in order:
            times[name].append(run_worker(__file__, name, args.steps, args.warmup)["median_step_s"])
            print(f"repeat {repeat} {name}: {times[name][-1] * 1e3:.2f} ms/step", flush=True)
    baseline, ours = median(times["lightning"]), median(times["ours"])
    ratio = ours / baseline
    verdict = "met" if ratio <= 1.02 else "NOT met"
    body = (
        "GPT demo (4 layers, d_model 128, block 64, batch 16 per rank), 2 CPU processes (gloo), "
        f"{args.steps} steps per run, first {args.warmup} excluded, {args.repeats} alternating repeats.\n\n"
        "| strategy | median step time (ms) | runs (ms) |\n|---|---|---|\n"
        f"| Lightning `ddp` (baseline) | {baseline * 1e3:.2f} | "
        f"{', '.join(f'{t * 1e3:.1f}' for t in times['lightning'])} |\n"
        f"| lightning_mlopt `DDPStrategy` | {ours * 1e3:.2f} | "
        f"{', '.join(f'{t * 1e3:.1f}' for t in times['ours'])} |\n\n"
        f"**Ratio ours / Lightning: {ratio:.3f}** (goal <= 1.02: {verdict}).\n"
    )
    publish("ddp_step_time", "cpu-2proc", body)


if __name__ == "__main__":
    main()
