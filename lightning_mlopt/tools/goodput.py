"""``python -m lightning_mlopt goodput RUN_DIR [--format text|json] [--no-chart]``.

The run's goodput over all its launches, from the ledger GoodputLedger appends (``<run_dir>/goodput.jsonl``, on
by default in the CLI): the wall-clock time from the first launch's start to the end, the productive step
time (steps whose results survived) and the badput by category, each next to its ``ml-goodput-measurement``
name, as seconds and percent; each launch with how it ended; the step counts. With matplotlib installed it
writes a chart to ``<run_dir>/goodput.png``. Bad input (no such folder, no ledger, an unreadable line) ends
in one line and exit status 2, with nothing written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.goodput.report import CATEGORIES, GoodputReport, LedgerError, compute, read_ledger
from lightning_mlopt.run_dir import GOODPUT_CHART_NAME, GOODPUT_LEDGER_NAME
from lightning_mlopt.tools._preamble import ToolArgumentParser, bad_input


def _parser() -> ToolArgumentParser:
    parser = ToolArgumentParser(
        prog="python -m lightning_mlopt goodput",
        description="Goodput of a run over all its launches: productive step time and badput by category "
        "(ml-goodput-measurement's names), from <run_dir>/goodput.jsonl.",
    )
    parser.add_argument("run_dir", help=f"the run directory (or its {GOODPUT_LEDGER_NAME})")
    parser.add_argument("--format", choices=["text", "json"], default="text", help="text table (default) or JSON")
    parser.add_argument("--no-chart", action="store_true", help=f"do not write <run_dir>/{GOODPUT_CHART_NAME}")
    return parser


def load_report(run_dir: Path) -> tuple[Path, GoodputReport]:
    """The ledger of ``run_dir`` (a run directory or the ledger file) and its report.

    Raises:
        BadInputError: no such folder, no ledger in it, or a line that is not a ledger event.

    """
    if not run_dir.exists():
        raise BadInputError(f"{run_dir}: no such run directory")
    ledger = run_dir if run_dir.is_file() else run_dir / GOODPUT_LEDGER_NAME
    if not ledger.is_file():
        raise BadInputError(
            f"{run_dir}: no {GOODPUT_LEDGER_NAME} in it; the ledger is written by runs launched with the goodput "
            "ledger on (the CLI's default `goodput:`, or GoodputLedger() in a Trainer's callbacks)"
        )
    try:
        return ledger, compute(read_ledger(ledger))
    except (LedgerError, OSError) as error:
        raise BadInputError(str(error)) from None


def text(report: GoodputReport, title: str) -> str:
    """The report as a table: category, ml-goodput name, seconds, percent; launches; step counts."""
    lines = [
        f"Goodput of {title}: {report.goodput_percent:.1f}% of {report.total_s:.1f} s wall-clock "
        f"(first start to end, {len(report.launches)} launch{'es' if len(report.launches) != 1 else ''})",
        "",
        f"{'category':<28} {'ml-goodput-measurement':<40} {'seconds':>9} {'percent':>8}",
    ]
    for key, name, ml_name in CATEGORIES:
        lines.append(f"{name:<28} {ml_name:<40} {report.seconds[key]:>9.2f} {report.percent(key):>7.1f}%")
    total = sum(report.seconds.values())
    lines.append(f"{'sum':<28} {'':<40} {total:>9.2f} {100 * total / (report.total_s or 1):>7.1f}%")
    lines += ["", f"{'launch':>6} {'started':>9} {'lasted':>9} {'resumed at':>10} {'steps':>6} {'kept':>6}  ended"]
    first = report.launches[0].started if report.launches else 0.0
    for number, launch in enumerate(report.launches, start=1):
        resumed = "-" if launch.resumed_step is None else str(launch.resumed_step)
        lines.append(
            f"{number:>6} {f'+{launch.started - first:.1f} s':>9} {f'{launch.ended - launch.started:.1f} s':>9} "
            f"{resumed:>10} {launch.steps_run:>6} {launch.steps_survived:>6}  {launch.how_it_ended}"
        )
    lines += [
        "",
        f"steps: {report.steps_run} run, {report.steps_survived} survived; final global step {report.final_step}",
    ]
    return "\n".join(lines)


def write_chart(report: GoodputReport, path: Path, title: str) -> Path | None:
    """Stacked bars: the run's share of time by category, and each launch's seconds; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (share, per_launch) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 2]})
    launches = [str(number) for number in range(1, len(report.launches) + 1)]
    bottom, launch_bottom = 0.0, [0.0] * len(launches)
    for key, name, _ in CATEGORIES:
        share.bar(["run"], [report.percent(key)], bottom=bottom, label=name)
        bottom += report.percent(key)
        heights = [launch.seconds[key] for launch in report.launches]
        per_launch.bar(launches, heights, bottom=launch_bottom, label=name)
        launch_bottom = [b + h for b, h in zip(launch_bottom, heights, strict=True)]
    share.set_ylabel("% of wall-clock")
    share.set_title(f"goodput {report.goodput_percent:.1f}%")
    per_launch.set_xlabel("launch (time between launches: with the launch that follows)")
    per_launch.set_ylabel("seconds")
    per_launch.set_title(title)
    per_launch.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m lightning_mlopt goodput``; returns the exit status (2 on bad input)."""
    options = _parser().parse_args(list(argv))
    try:
        ledger, report = load_report(Path(options.run_dir))
    except BadInputError as error:
        return bad_input(error)
    title = ledger.parent.name
    if options.format == "json":
        print(json.dumps({"ledger": str(ledger), **report.as_dict()}, indent=2))
    else:
        print(text(report, title))
    if not options.no_chart:
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(report.launches[0].started))
        chart = write_chart(report, ledger.parent / GOODPUT_CHART_NAME, f"{title} (from {started})")
        if options.format == "text":
            print(f"Chart: {chart}" if chart else "(pip install matplotlib for the chart)")
    return 0
