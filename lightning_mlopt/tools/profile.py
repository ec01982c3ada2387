"""``python -m lightning_mlopt profile --config FILE [--config OVERLAY ...] [--steps N] [--scaling 1,2,4]``.

A diagnosis of "why is my run slow?" in one command. It runs, each as a short ``fit`` of its own in
``<run_dir>/profile/`` (the run's own checkpoints and logs are not touched):

1. the loader-only ceiling: the configured dataloader iterated exactly as training would (same sampler,
   workers, batch size, device transfer) with a model that does nothing (:class:`LoaderOnly`);
2. training for ``--steps`` steps, measured by PerformanceMonitor (step breakdown per rank, MFU, memory);
3. with ``--scaling``, training at each process count, for the scaling efficiency.

It prints a verdict (input-, communication- or compute-bound, with the numbers that decided it) and a table,
and writes them to ``<run_dir>/profile.md`` with a chart (``profile.png``, when matplotlib is installed).
Arguments it does not know (``--trainer.devices=2``) go to every run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.run_dir import (
    PERF_DIR,
    PERF_SUMMARY_NAME,
    PROFILE_CHART_NAME,
    PROFILE_REPORT_NAME,
    PROFILE_RUNS_DIR,
)
from lightning_mlopt.tools._child_fit import checked_fit, run_child_fit
from lightning_mlopt.tools._preamble import ToolArgumentParser, bad_input, fit_arguments

# Every measured run: its own run directory, no resume, no saves at the end, no logger, no validation.
_MEASURED_RUN = (
    "--checkpoint.resume.auto=false",
    "--checkpoint.save_on.train_end=false",
    "--checkpoint.save_on.epoch_end=false",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0",
)
# The loader-only run: a model with no optimizer, so none of the settings that need one.
_LOADER_ONLY = (
    "--trainer.strategy=ddp",
    "--trainer.accumulate_grad_batches=1",
    "--trainer.gradient_clip_val=null",
    "--trainer.precision=32-true",
    "--trainer.max_steps=-1",
    "--trainer.max_epochs=1",
    "--performance.count_flops=false",
    "--performance.measure_peak=false",
)


def _parser() -> ToolArgumentParser:
    parser = ToolArgumentParser(
        prog="python -m lightning_mlopt profile",
        description="Where a run's step time goes: loader-only ceiling, training breakdown per rank, MFU, a "
        "verdict, and optionally scaling efficiency. Arguments not listed here (e.g. --trainer.devices=2) go "
        "to every measured run.",
    )
    parser.add_argument("--config", "-c", action="append", required=True, help="config file(s), in order")
    parser.add_argument("--steps", type=int, default=30, help="training steps measured per run (default 30)")
    parser.add_argument(
        "--scaling", default=None, help="process counts to compare, e.g. 1,2,4 (one node: trainer.devices)"
    )
    parser.add_argument("--trace", action="store_true", help="also record a 3-step torch.profiler trace per rank")
    return parser


def _process_counts(text: str | None) -> list[int]:
    if text is None:
        return []
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise BadInputError(f"--scaling {text}: expected process counts separated by commas, e.g. 1,2,4") from None
    if len(counts) < 2 or counts[0] < 1:
        raise BadInputError(f"--scaling {text}: give at least two process counts, each >= 1, e.g. 1,2")
    return counts


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m lightning_mlopt profile``; returns the exit status (2 on bad input)."""
    options, extra = _parser().parse_known_args(list(argv))
    base_args = fit_arguments(options.config, extra)
    try:
        if options.steps < 2:
            raise BadInputError(f"--steps must be >= 2 (the first step is warm-up), got {options.steps}")
        counts = _process_counts(options.scaling)
        config, run_dir = checked_fit(base_args)
    except BadInputError as error:
        return bad_input(error)
    folder = run_dir / PROFILE_RUNS_DIR
    steps = options.steps + 1  # the monitor leaves the first batch out
    runs: dict[str, dict[str, Any]] = {}
    plan: list[tuple[str, list[str]]] = [
        ("loader-only", [_loader_only_model(config), *_LOADER_ONLY, f"--trainer.limit_train_batches={steps}"]),
    ]
    trace = [f"--performance.profile_steps=[{steps // 2},{steps // 2 + 3}]"] if options.trace else []
    if counts:
        plan += [(f"train-n{n}", [f"--trainer.max_steps={steps}", f"--trainer.devices={n}", *trace]) for n in counts]
    else:
        plan.append(("train", [f"--trainer.max_steps={steps}", *trace]))
    for name, arguments in plan:
        print(f"profile: measuring {name} ({options.steps} steps) ...", flush=True)
        summary = _measure(base_args, [*_MEASURED_RUN, *arguments], folder / name)
        if isinstance(summary, int):
            return summary
        runs[name] = summary
    return _conclude(run_dir, runs, counts, _title(options.config, options.steps))


def _loader_only_model(config: dict[str, Any]) -> str:
    """``--model=`` LoaderOnly wrapping the configured model (built for its dataloaders, never trained)."""
    wrapper = {"class_path": "lightning_mlopt.perf.loader_only.LoaderOnly", "init_args": {"model": config["model"]}}
    return f"--model={json.dumps(wrapper)}"


def _measure(base_args: list[str], arguments: list[str], folder: Path) -> dict[str, Any] | int:
    """Run one measured ``fit`` into ``folder``: its PerformanceMonitor summary, or the exit status to end with."""
    summary_path = folder / PERF_DIR / PERF_SUMMARY_NAME
    code = run_child_fit([*base_args, *arguments], folder, expected=summary_path)
    return code if code else dict(json.loads(summary_path.read_text()))


def _title(configs: Sequence[str], steps: int) -> str:
    return f"Profile of {' + '.join(Path(path).name for path in configs)} ({steps} steps per run)"


def _conclude(run_dir: Path, runs: dict[str, dict[str, Any]], counts: list[int], title: str) -> int:
    from lightning_mlopt.perf.report import markdown, write_chart
    from lightning_mlopt.perf.verdict import decide, scaling_efficiency

    efficiency = (
        scaling_efficiency({n: runs[f"train-n{n}"]["metrics"]["perf/samples_per_sec"] for n in counts})
        if counts
        else None
    )
    train_name = f"train-n{counts[-1]}" if counts else "train"
    verdict = decide(runs[train_name], runs.get("loader-only"), efficiency)
    run_dir.mkdir(parents=True, exist_ok=True)
    chart = write_chart(run_dir / PROFILE_CHART_NAME, runs[train_name], train_name, efficiency, runs)
    report = markdown(title, runs, train_name, verdict, efficiency, chart)
    (run_dir / PROFILE_REPORT_NAME).write_text(report)
    print(report)
    print(
        f"Report: {run_dir / PROFILE_REPORT_NAME}"
        + (f", chart: {chart}" if chart else " (pip install matplotlib for the chart)")
    )
    return 0
