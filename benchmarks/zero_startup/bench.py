"""ZeRO-2 start-up against DDP's: time to the first step of a 2-process CLI fit on CPU, and what DeepSpeed says.

    python benchmarks/zero_startup/bench.py [--repeats 3]

Each job is the command a user runs, as a fresh process (``OMP_NUM_THREADS=1``, its own run folder)::

    python -m lightning_mlopt fit --config configs/gpt.yaml --config configs/strategies/<ddp|zero2>.yaml \\
        --trainer.accelerator=cpu --trainer.devices=2 --trainer.max_steps=2

**Time to first step**: from just before the job is started to the first step's record in the run's goodput
ledger (``goodput.jsonl``, wall-clock time on this machine): interpreter, imports, parsing, the launch of
rank 1, process group, DeepSpeed's set-up and one step.

Arms, in one run:

- ``ddp``: the baseline.
- ``zero2``: ``TORCH_EXTENSIONS_DIR`` is one folder for the whole run, filled (if DeepSpeed builds anything)
  by the warm-up launch: every launch after the first on a machine.
- ``zero2 cold``: an empty ``TORCH_EXTENSIONS_DIR`` for each job: the first launch on a machine (a fresh VM,
  container or CI runner), where DeepSpeed would JIT-compile its CPU ops.

One warm-up launch of ``ddp`` and ``zero2`` comes first and is not counted; then ``--repeats`` rounds of the
three arms, the order rotating (drift on a shared machine hits every arm), median per arm, the ratio to DDP. For each
ZeRO launch it also counts DeepSpeed's "... built successfully" and "Setting accelerator to CPU" lines and
lists the ops in the extension folder afterwards.

Goal: ZeRO-2 / DDP <= 1.5 (time to first step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TypedDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import median, publish

REPO = Path(__file__).resolve().parents[2]
GOAL = 1.5
BUILT = "built successfully"  # DeepSpeed's print after it loads (or builds) a JIT op, in every rank
ACCELERATOR = "Setting accelerator to CPU"  # DeepSpeed's warning when it detects no accelerator


class Job(TypedDict):
    """One launch: its time to first step, DeepSpeed's lines in its output, the ops in its extension folder."""

    seconds: float
    built_lines: int
    accelerator_lines: int
    ops: list[str]


def _job(strategy: str, work: Path, name: str, extensions: Path) -> Job:
    """One CLI fit; its time to first step and the DeepSpeed lines in its output."""
    run_dir = work / name
    command = [
        sys.executable,
        "-m",
        "lightning_mlopt",
        "fit",
        "--config",
        str(REPO / "configs" / "gpt.yaml"),
        "--config",
        str(REPO / "configs" / "strategies" / f"{strategy}.yaml"),
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.max_steps=2",
        f"--run_dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(extensions)}
    for variable in ("MASTER_PORT", "MASTER_ADDR", "DS_ACCELERATOR"):
        env.pop(variable, None)
    started = time.time()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}:\n" + "\n".join(output.splitlines()[-30:]))
    ledger = next(run_dir.rglob("goodput.jsonl"))
    events = [json.loads(line) for line in ledger.read_text().splitlines()]
    first_step = next(event["time"] for event in events if event["event"] == "step")
    return {
        "seconds": first_step - started,
        "built_lines": output.count(BUILT),
        "accelerator_lines": output.count(ACCELERATOR),
        "ops": sorted({library.parent.name for library in extensions.rglob("*.so")}),  # each op's build folder
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="zero_startup_"))
    try:
        runs = _measure(work, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from lightning_mlopt.strategies.deepspeed.deepspeed_startup import name_deepspeed_accelerator

    name_deepspeed_accelerator()  # the result file's versions line imports DeepSpeed in this process
    publish("zero_startup", "cpu", _report(runs, args.repeats))


def _measure(work: Path, repeats: int) -> dict[str, list[Job]]:
    """The warm-up launches, then ``repeats`` rounds of every arm; each arm's jobs."""
    warm_cache = work / "torch_extensions"
    runs: dict[str, list[Job]] = {"ddp": [], "zero2": [], "zero2 cold": []}
    for strategy in ("ddp", "zero2"):
        warm = _job(strategy, work, f"warmup-{strategy}", warm_cache)
        print(f"warm-up {strategy}: {warm['seconds']:.1f} s", flush=True)
    arms = list(runs)
    for repeat in range(repeats):
        for arm in arms[repeat % 3 :] + arms[: repeat % 3]:  # rotated, so drift hits every arm
            extensions = work / f"torch_extensions_cold_{repeat}" if arm == "zero2 cold" else warm_cache
            result = _job(arm.split()[0], work, f"{arm.replace(' ', '-')}-{repeat}", extensions)
            runs[arm].append(result)
            print(f"{arm}, repeat {repeat}: {result['seconds']:.1f} s", flush=True)
    return runs


def _report(runs: dict[str, list[Job]], repeats: int) -> str:
    ddp = median([r["seconds"] for r in runs["ddp"]])
    labels = {
        "ddp": "DDP (baseline)",
        "zero2": "ZeRO-2, extension folder of earlier launches",
        "zero2 cold": "ZeRO-2, empty extension folder (first launch on a machine)",
    }
    rows, details = [], []
    for arm, label in labels.items():
        if not runs[arm]:
            continue
        seconds = median([r["seconds"] for r in runs[arm]])
        ratio = seconds / ddp
        goal = "" if arm == "ddp" else f"<= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'}"
        last = runs[arm][-1]
        lines = "" if arm == "ddp" else f"{last['built_lines']} / {last['accelerator_lines']}"
        ops = "" if arm == "ddp" else (", ".join(last["ops"]) or "none")
        rows.append(f"| {label} | {len(runs[arm])} | {seconds:.1f} | {ratio:.2f} | {goal} | {lines} | {ops} |")
        details.append(f"{arm}: " + ", ".join(f"{r['seconds']:.1f}" for r in runs[arm]))
    return (
        "## Time to first step, GPT demo (4 layers, d_model 128), CLI fit on 2 CPU processes\n\n"
        f"One warm-up launch of DDP and ZeRO-2, then {repeats} rounds of the three arms, order rotating; "
        "median per arm. "
        "Wall clock from starting `python -m lightning_mlopt fit ...` to the first step's record in the run's "
        'goodput ledger. DeepSpeed lines: its "... built successfully" / "Setting accelerator to CPU" lines in '
        "one launch's output (both ranks); ops: what is in `TORCH_EXTENSIONS_DIR` after it.\n\n"
        "| arm | jobs | time to first step (s) | / DDP | goal | DeepSpeed lines (built / accelerator) | ops built |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\nPer job (s): " + "; ".join(details) + ".\n"
    )


if __name__ == "__main__":
    main()
