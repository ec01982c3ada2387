"""Step-time parity: our strategies through the CLI against a hand-written loop and Lightning's own strategy.

    python benchmarks/parity/bench.py                                    # every strategy, both models
    python benchmarks/parity/bench.py --strategies ddp,fsdp --models gpt --repeats 5 --no-publish

For each strategy and model, three arms, each a fresh 2-process job on CPU (gloo):

- ``ours``: ``python -m lightning_mlopt fit --config configs/gpt.yaml --config configs/strategies/<s>.yaml``
  with its default callbacks (FaultTolerantCheckpoint as configured, PerformanceMonitor, the tracker the
  config names; the progress bar off, as in a batch job);
- ``hand``: ``benchmarks/parity/hand_loop.py`` under torchrun: the library alone (``DistributedDataParallel``,
  ``fully_shard``, ``parallelize_module``, ``deepspeed.initialize``), the same seed, data order, AdamW groups,
  warm-up and clipping;
- ``loop``: the same plain Lightning Trainer (``benchmarks/parity/lightning_loop.py --our-strategy``) with our
  strategy and no callback of ours: Lightning's loop around the library, the part of our step a Lightning
  plugin cannot remove (its hooks, closure, progress tracking, the demo's ``self.log``, its per-batch SIGTERM
  broadcast). ``loop / hand`` measures it alone; ``ours / loop`` is what our CLI and callbacks add to it;
- ``lightning``: ``benchmarks/parity/lightning_loop.py``: a plain Lightning Trainer with Lightning's ``ddp`` or
  ``ModelParallelStrategy`` (its DeepSpeedStrategy refuses CPU).

The figure is the mean wall time of a step, timed inside each run from one batch's start to the next (the
loop's work between batches included; ``step_clock.py``, and the same stamp in the hand loop), over the steps
after the first ``WARMUP``: start-up is left out without subtracting two noisy job times. One job per arm and
repeat, arms interleaved (the order alternates between repeats, so drift hits every arm); the table gives
the median over repeats and each repeat. The final weights of ``ours`` (consolidated from its final
checkpoint) are compared bit for bit with the hand loop's.

Models: ``gpt`` (configs/gpt.yaml; 60-step jobs) and ``gpt-tiny`` (2 layers, d_model 32, 16 tokens, batch 4:
a short step, so fixed per-step costs show; 300-step jobs). Goals (issue 27): ours <= 1.02 x
the hand loop, <= 1.00 x Lightning's own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "benchmarks"))
from _common import median, publish, run_fresh_job  # noqa: E402

STRATEGIES = ["ddp", "fsdp", "tp", "pp", "zero1", "zero2", "zero3"]
LIGHTNING_RUNS = {"ddp", "fsdp"}
MODELS: dict[str, list[str]] = {
    "gpt": [],
    "gpt-tiny": [
        "model.init_args.n_layer=2",
        "model.init_args.d_model=32",
        "model.init_args.n_head=2",
        "model.init_args.block_size=16",
        "data.init_args.block_size=16",
        "data.init_args.batch_size=4",
    ],
}
# Steps per job: each model's steady steps take several seconds. The first WARMUP are in no figure.
STEPS = {"gpt": 60, "gpt-tiny": 300}
WARMUP = 5
HAND_GOAL, LIGHTNING_GOAL = 1.02, 1.00


def _command(arm: str, strategy: str, model: str, steps: int, work: Path) -> list[str]:
    overrides = MODELS[model]
    clock = work / "step_times.json"
    if arm == "ours":
        return [
            *[sys.executable, "-m", "lightning_mlopt", "fit", "--config", str(REPO / "configs" / "gpt.yaml")],
            *["--config", str(REPO / "configs" / "strategies" / f"{strategy}.yaml")],
            *["--trainer.accelerator=cpu", "--trainer.devices=2", f"--trainer.max_steps={steps}"],
            *[f"--run_dir={work / 'run'}", "--trainer.enable_progress_bar=false"],
            *["--trainer.callbacks+=step_clock.StepClock", f"--trainer.callbacks.out={clock}"],
            *[f"--{item}" for item in overrides],
        ]
    sets = [f"--set={item}" for item in overrides]
    if arm == "hand":
        return [
            *[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
            *[str(HERE / "hand_loop.py"), f"--strategy={strategy}", f"--steps={steps}"],
            *[f"--out={work / 'hand_params.pt'}", f"--step-times={clock}", *sets],
        ]
    # "loop": our strategy in a plain Trainer; "lightning+checkpoint": Lightning's, plus one of our callbacks.
    extra = ["--our-strategy"] if arm == "loop" else [f"--with={name}" for name in arm.split("+")[1:]]
    return [
        *[sys.executable, str(HERE / "lightning_loop.py"), f"--strategy={strategy}", f"--steps={steps}"],
        *[f"--root={work / 'lightning'}", f"--step-times={clock}", *sets, *extra],
    ]


def _timed_job(arm: str, strategy: str, model: str, steps: int, work: Path) -> float:
    """The mean step time of one job after its first WARMUP steps; a failing job stops the benchmark, saying why."""
    work.mkdir(parents=True, exist_ok=True)
    command = _command(arm, strategy, model, steps, work)
    run_fresh_job(command, work, f"{arm} {strategy} {model} ({steps} steps)", pythonpath=f"{REPO}{os.pathsep}{HERE}")
    step_s = json.loads((work / "step_times.json").read_text())["step_s"][WARMUP:]
    return sum(step_s) / len(step_s)


def _bitwise(work_ours: Path, work_hand: Path) -> str:
    """Whether our final weights equal the hand loop's bit for bit; else the largest difference."""
    import torch

    consolidated = work_ours / "consolidated.ckpt"
    subprocess.run(
        [sys.executable, "-m", "lightning_mlopt", "checkpoint", "consolidate", str(work_ours / "run" / "checkpoints"),
         str(consolidated)],
        check=True, capture_output=True, cwd=REPO,
    )  # fmt: skip
    ours = torch.load(consolidated, weights_only=False)["state_dict"]
    hand = torch.load(work_hand / "hand_params.pt")
    if ours.keys() != hand.keys():
        return f"different parameter names ({sorted(set(ours) ^ set(hand))[:3]})"
    worst = max(float((ours[name] - hand[name]).abs().max()) for name in ours)
    return "yes" if worst == 0 else f"no (max abs difference {worst:.1e})"


def _interleaved(
    arms: list[str], strategy: str, model: str, args: argparse.Namespace, scratch: Path
) -> tuple[dict[str, list[float]], dict[str, Path]]:
    """Each arm's mean step time per repeat, arms interleaved (the order alternates); each arm's last work dir."""
    steps = args.steps or STEPS[model]
    per_step: dict[str, list[float]] = {arm: [] for arm in arms}
    last: dict[str, Path] = {}
    for repeat in range(args.repeats):
        for arm in arms if repeat % 2 == 0 else arms[::-1]:
            work = scratch / f"{strategy}-{model}-{arm}-{repeat}"
            per_step[arm].append(_timed_job(arm, strategy, model, steps, work))
            last[arm] = work
            print(f"{strategy} {model} {arm} repeat {repeat}: {per_step[arm][-1] * 1e3:.1f} ms/step", flush=True)
    return per_step, last


def measure(strategy: str, model: str, args: argparse.Namespace, scratch: Path) -> dict[str, object]:
    arms = ["ours", "hand", "loop"] + (["lightning"] if strategy in LIGHTNING_RUNS else [])
    per_step, last = _interleaved(arms, strategy, model, args, scratch)
    result: dict[str, object] = {arm: per_step[arm] for arm in arms}
    result["steps"] = str(args.steps or STEPS[model])
    result["bitwise"] = _bitwise(last["ours"], last["hand"])
    return result


def _row(strategy: str, model: str, result: dict[str, object]) -> str:
    def cell(arm: str) -> str:
        runs = result.get(arm)
        if runs is None:  # ZeRO: Lightning's DeepSpeedStrategy refuses a CPU; TP: its recipe is the model's own code
            return "not run (TP in Lightning is the model's own code)" if strategy == "tp" else "not run (refuses CPU)"
        return f"{median(runs) * 1e3:.1f} ({', '.join(f'{t * 1e3:.1f}' for t in runs)})"  # type: ignore[arg-type]

    ours, hand, loop = (median(result[arm]) for arm in ("ours", "hand", "loop"))  # type: ignore[arg-type]
    lightning = result.get("lightning")
    lightning_ratio = f"{ours / median(lightning):.2f}" if lightning else "-"  # type: ignore[arg-type]
    return (
        f"| {strategy} | {model} ({result['steps']}) | {cell('ours')} | {cell('hand')} | {cell('loop')} | "
        f"{cell('lightning')} | **{ours / hand:.2f}** | {loop / hand:.2f} | **{ours / loop:.2f}** | "
        f"{lightning_ratio} | {result['bitwise']} |"
    )


ALL_THREE = "lightning+checkpoint+performance+goodput"
# The ablation's arms, in the table's order, with what each runs per step.
ABLATION_NOTES = {
    "lightning": "Lightning's own strategy, no callback of ours (its SIGTERM broadcast every batch)",
    "lightning+checkpoint": "FaultTolerantCheckpoint: the per-step vote (one all-reduce in place of Lightning's "
    "SIGTERM broadcast, in the background with steps under a second) and its bookkeeping",
    "lightning+performance": "PerformanceMonitor: phase clocks every step, a window sum every logging step",
    "lightning+goodput": "GoodputLedger: one appended record per step",
    ALL_THREE: "the three together",
    "ours": "our CLI with its defaults (the three, the run directory, the config's logger, the process guards)",
}
ABLATION_ARMS = list(ABLATION_NOTES)


def ablation_rows(strategy: str, model: str, args: argparse.Namespace, scratch: Path) -> list[str]:
    """Each of our default callbacks alone on Lightning's own strategy, the three together and our CLI: the rows."""
    per_step, _ = _interleaved(ABLATION_ARMS, strategy, model, args, scratch)
    base = median(per_step["lightning"])
    rows = []
    for arm in ABLATION_ARMS:
        runs = per_step[arm]
        cell = f"{median(runs) * 1e3:.2f} ({', '.join(f'{t * 1e3:.2f}' for t in runs)})"
        added = median(runs) - base
        what = ABLATION_NOTES[arm]
        change = "-" if arm == "lightning" else f"{added * 1e3:+.2f} ms ({added / base:+.1%})"
        rows.append(f"| {strategy} | {model} | {arm} | {cell} | {change} | {what} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=0, help="steps per job (default: per model, STEPS)")
    parser.add_argument("--no-publish", action="store_true", help="print the table; write no result file")
    parser.add_argument(
        "--ablation", action="store_true",
        help="instead: each of our default callbacks alone on Lightning's own strategy (ddp, fsdp)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.ablation:
        _ablation(args)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="parity_") as scratch:
        for model in args.models.split(","):
            for strategy in args.strategies.split(","):
                rows.append(_row(strategy, model, measure(strategy, model, args, Path(scratch))))
    body = (
        f"Step time (ms): the mean over a job's steps after the first {WARMUP}, timed inside the run from one "
        f"batch's start to the next (the model column gives the job's steps), {args.repeats} interleaved repeats "
        f"(median, then each repeat), 2 CPU processes (gloo). Goals: ours <= {HAND_GOAL:.2f} x the hand-written "
        f"loop, <= {LIGHTNING_GOAL:.2f} x Lightning's own strategy; where Lightning's loop alone (the loop arm: a "
        "plain Trainer with our strategy and no callback of ours) is over that, what we add to it (ours / loop).\n\n"
        "| strategy | model | ours (CLI, default callbacks) | hand-written loop | Lightning's loop, our strategy, "
        "no callback of ours | Lightning's own | ours / hand | Lightning's loop alone: loop / hand | what we add: "
        "ours / loop | ours / Lightning | final weights bitwise equal to the hand loop's |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    if args.no_publish:
        print(body)
    else:
        publish("parity", "cpu-2proc", body)


def _ablation(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="parity_ablation_") as scratch:
        for model in args.models.split(","):
            for strategy in args.strategies.split(","):
                if strategy not in LIGHTNING_RUNS:
                    continue  # Lightning's DeepSpeedStrategy refuses CPU: no plain run to add a callback to
                rows += ablation_rows(strategy, model, args, Path(scratch))
    body = (
        f"Each of our default callbacks alone, added to a plain Lightning Trainer with Lightning's own strategy: "
        f"step time (ms) as in the parity table (mean after the first {WARMUP} steps, {args.repeats} interleaved "
        "repeats: median, then each repeat), and what the callback adds over Lightning's own run.\n\n"
        "| strategy | model | arm | step time (ms) | added per step | what runs per step |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    if args.no_publish:
        print(body)
    else:
        publish("parity-ablation", "cpu-2proc", body)


if __name__ == "__main__":
    main()
