"""Where the step time between two loops goes: a profiler window over the same steps of each, op by op.

    python benchmarks/parity/trace_compare.py --strategy fsdp             # hand loop, Lightning's loop, our CLI
    python benchmarks/parity/trace_compare.py --strategy fsdp --repeats 3 --no-publish

The arms are the parity benchmark's (``bench.py``): ``hand`` (the library alone under torchrun), ``loop`` (a
plain Lightning Trainer with our strategy and no callback of ours) and ``ours`` (the CLI with its default
callbacks, the bar off as in a batch job). Each job profiles steps ``--start`` to ``--stop`` on rank zero
(``trace_window.py``: torch.profiler, CPU, no stacks); the table gives each op's and region's self CPU
milliseconds per step in each arm (median over repeats), the ops whose difference is largest first, so that
what a loop adds shows as the ops and regions it adds or makes slower. The window's wall time per step is
the first row. Results: ``results/parity-trace_cpu-2proc_<yyyymm>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _common import median, publish, run_fresh_job  # noqa: E402
from bench import REPO, _command  # noqa: E402

ARMS = ("hand", "loop", "ours")


def _traced(arm: str, strategy: str, steps: int, window: tuple[int, int], work: Path) -> dict:
    """One job of ``arm`` with the profiler window; rank zero's trace."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "trace.json"
    trace = f"{window[0]},{window[1]},{out}"
    command = _command(arm, strategy, "gpt", steps, work)
    if arm == "ours":
        command += [
            "--trainer.callbacks+=trace_window.TraceSteps", f"--trainer.callbacks.start={window[0]}",
            f"--trainer.callbacks.stop={window[1]}", f"--trainer.callbacks.out={out}",
        ]  # fmt: skip
    else:
        command.append(f"--trace={trace}")
    run_fresh_job(command, work, f"{arm} {strategy}", pythonpath=f"{REPO}{os.pathsep}{HERE}")
    return json.loads(out.read_text())


def table(traces: dict[str, list[dict]], rows: int) -> str:
    """Per op, self CPU ms per step in each arm (median of repeats); the largest differences first."""
    per_step: dict[str, dict[str, float]] = {}
    for arm, runs in traces.items():
        names = {op["name"] for run in runs for op in run["ops"]}
        for name in names:
            values = [
                sum(op["self_cpu_us"] for op in run["ops"] if op["name"] == name) / 1e3 / run["steps"] for run in runs
            ]
            per_step.setdefault(name, {})[arm] = median(values)
    walls = {arm: median([run["wall_s"] * 1e3 / run["steps"] for run in runs]) for arm, runs in traces.items()}
    arms = list(traces)
    header = "| op or region | " + " | ".join(f"{arm} (ms/step)" for arm in arms) + " | ours - hand |"
    lines = [header, "|---|" + "---|" * (len(arms) + 1)]
    lines.append(
        "| **wall time of a step** | "
        + " | ".join(f"**{walls[arm]:.2f}**" for arm in arms)
        + f" | **{walls['ours'] - walls['hand']:+.2f}** |"
    )
    ranked = sorted(per_step.items(), key=lambda item: -abs(item[1].get("ours", 0) - item[1].get("hand", 0)))
    for name, values in ranked[:rows]:
        cells = " | ".join(f"{values.get(arm, 0.0):.3f}" for arm in arms)
        lines.append(f"| `{name}` | {cells} | {values.get('ours', 0) - values.get('hand', 0):+.3f} |")
    totals = {arm: sum(values.get(arm, 0.0) for values in per_step.values()) for arm in arms}
    lines.append(
        "| all ops' self CPU time | "
        + " | ".join(f"{totals[arm]:.2f}" for arm in arms)
        + f" | {totals['ours'] - totals['hand']:+.2f} |"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--start", type=int, default=20)
    parser.add_argument("--stop", type=int, default=40)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--no-publish", action="store_true")
    args = parser.parse_args()
    steps = args.stop + 2
    traces: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="parity_trace_") as scratch:
        for repeat in range(args.repeats):
            for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
                trace = _traced(arm, args.strategy, steps, (args.start, args.stop), Path(scratch) / f"{arm}-{repeat}")
                traces[arm].append(trace)
                print(f"{arm} repeat {repeat}: {trace['wall_s'] * 1e3 / trace['steps']:.1f} ms/step", flush=True)
    body = (
        f"GPT demo (configs/gpt.yaml), {args.strategy}, 2 CPU processes (gloo), steps {args.start}-{args.stop - 1} "
        f"profiled on rank 0 (torch.profiler, CPU), median of {args.repeats} interleaved repeats. `hand`: the "
        "library alone under torchrun; `loop`: a plain Lightning Trainer with our strategy, no callback of ours; "
        "`ours`: the CLI with its defaults. Self CPU time of each op or region per step, the largest "
        "differences between ours and the hand loop first.\n\n" + table(traces, args.rows)
    )
    if args.no_publish:
        print(body)
    else:
        publish(f"parity-trace-{args.strategy}", "cpu-2proc", body)


if __name__ == "__main__":
    main()
