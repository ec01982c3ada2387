"""The ``profile`` report: a markdown table and verdict, and a chart (PNG, with matplotlib when installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_mlopt.perf.breakdown import JobWindow, RankWindow
from lightning_mlopt.perf.verdict import SCALING_FLOOR, Verdict
from lightning_mlopt.process.phase import PHASES


def _percent(value: float | None) -> str:
    return f"{100 * value:.1f}%" if value is not None else "n/a"


def run_row(name: str, summary: dict[str, Any]) -> str:
    """One markdown row: a measured run's throughput, step time, breakdown, MFU and memory."""
    m = summary["metrics"]
    shares = " | ".join(_percent(m.get(f"perf/frac_{'data_wait' if p == 'data' else p}")) for p in PHASES)
    return (
        f"| {name} | {summary['world_size']} | {m['perf/samples_per_sec']:.1f} | "
        f"{m['perf/samples_per_sec_rank_min']:.1f} / {m['perf/samples_per_sec_rank_median']:.1f} / "
        f"{m['perf/samples_per_sec_rank_max']:.1f} | {1e3 * m['perf/step_time_s']:.1f} | {shares} | "
        f"{_percent(m.get('perf/mfu_measured'))} | {_percent(m.get('perf/mfu'))} | {m['perf/peak_memory_gb']:.2f} |"
    )


RUN_HEADER = (
    "| run | processes | samples/s | per rank min / median / max | step ms | data wait | forward | backward "
    "| optimizer | checkpoint | MFU (measured peak) | MFU (published peak) | peak memory GB |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def markdown(
    title: str,
    runs: dict[str, dict[str, Any]],
    train_name: str,
    verdict: Verdict,
    efficiency: dict[int, float] | None,
    chart: Path | None,
) -> str:
    """The whole report."""
    train = runs[train_name]
    lines = [f"# {title}", "", f"**Verdict: {verdict.kind}.** " + "; ".join(verdict.reasons) + ".", ""]
    lines += [RUN_HEADER, *(run_row(name, summary) for name, summary in runs.items()), ""]
    lines += [f"Per rank, `{train_name}` (fractions of the step):", "", "```", _rank_table(train), "```", ""]
    if train.get("flops_per_sample"):
        lines.append(
            f"FLOPs per sample (forward + backward): {train['flops_per_sample']:.4g}; device: {train['device']}, "
            f"matmul precision {train['precision']}"
            + (
                f", published dense peak {train['published_peak_flops'] / 1e12:.1f} TFLOP/s"
                if train.get("published_peak_flops")
                else " (no published peak for this device: MFU against the measured matmul peak only)"
            )
            + "."
        )
        lines.append("")
    if efficiency:
        lines += ["| processes | samples/s | scaling efficiency |", "|---|---|---|"]
        for count, value in sorted(efficiency.items()):
            summary = runs[f"train-n{count}"]
            flag = " (below 80%)" if value < SCALING_FLOOR else ""
            lines.append(f"| {count} | {summary['metrics']['perf/samples_per_sec']:.1f} | {100 * value:.0f}%{flag} |")
        lines.append("")
    if chart is not None:
        lines += [f"![step breakdown]({chart.name})", ""]
    return "\n".join(lines)


def _rank_table(summary: dict[str, Any]) -> str:
    return JobWindow([RankWindow(**rank) for rank in summary["ranks"]]).table()


def write_chart(
    path: Path, summary: dict[str, Any], name: str, scaling: dict[int, float] | None, runs: dict[str, dict[str, Any]]
) -> Path | None:
    """Stacked bars of each rank's step breakdown (and the scaling curve); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ranks = [RankWindow(**rank) for rank in summary["ranks"]]
    panels = 2 if scaling else 1
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    bars = axes[0][0]
    bottom = [0.0] * len(ranks)
    for phase in PHASES:
        heights = [1e3 * getattr(r, phase) / r.batches if r.batches else 0.0 for r in ranks]
        label = "data wait" if phase == "data" else phase
        bars.bar([str(i) for i in range(len(ranks))], heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    bars.set_xlabel("rank")
    bars.set_ylabel("ms per step")
    bars.set_title(f"where the step time goes ({name})")
    bars.legend(fontsize="small")
    if scaling:
        curve = axes[0][1]
        counts = sorted(scaling)
        measured = [runs[f"train-n{n}"]["metrics"]["perf/samples_per_sec"] for n in counts]
        ideal = [measured[0] * n / counts[0] for n in counts]
        curve.plot(counts, measured, marker="o", label="measured")
        curve.plot(counts, ideal, linestyle="--", label="linear")
        curve.set_xticks(counts)
        curve.set_xlabel("processes")
        curve.set_ylabel("samples/s")
        curve.set_title("scaling")
        curve.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
