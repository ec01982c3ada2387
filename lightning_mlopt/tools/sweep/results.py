"""What each trial left on disk: its metric (``metrics.json``), the results table and ``results.csv``."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_mlopt.run_dir import METRICS_NAME
from lightning_mlopt.tools.sweep.spec import SweepSpec, Trial


def trial_name(number: int) -> str:
    """The folder of trial ``number`` in a local or SLURM-array sweep: ``trial-007``."""
    return f"trial-{number:03d}"


@dataclass
class TrialResult:
    """One trial's outcome: its folder, values, metric (None if missing) and status."""

    name: str
    trial: Trial
    metric: float | None
    status: str
    seconds: float
    exit_code: int = 0


def collect_results(spec: SweepSpec, trials: Sequence[Trial], sweep_dir: Path) -> list[TrialResult]:
    """What is on disk for each trial (its ``metrics.json``), without running anything."""
    results = []
    for number, trial in enumerate(trials):
        name = trial_name(number)
        metric = read_metric(sweep_dir / name, spec.metric)
        started = (sweep_dir / name / "params.json").is_file()
        finished = logged_metrics(sweep_dir / name) is not None
        status = (
            "done" if metric is not None else "no metric" if finished else "not finished" if started else "not started"
        )
        results.append(TrialResult(name, trial, metric, status, 0.0))
    return results


def collect_run_dirs(spec: SweepSpec, sweep_dir: Path) -> list[TrialResult]:
    """Results of the trials a W&B agent ran under ``sweep_dir``.

    Each trial's values come from its resolved ``config.yaml`` (the CLI writes it), its metric from
    ``metrics.json``.
    """
    results = []
    for config_path in sorted(sweep_dir.glob("*/config.yaml")):
        config = yaml.safe_load(config_path.read_text()) or {}
        trial = {key: _lookup(config, key) for key in spec.parameters}
        metric = read_metric(config_path.parent, spec.metric)
        results.append(TrialResult(config_path.parent.name, trial, metric, "done" if metric is not None else "-", 0.0))
    return results


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def read_metric(folder: Path, name: str) -> float | None:
    """Metric ``name`` from the ``metrics.json`` a fit wrote into ``folder``; None if absent or unreadable."""
    path = folder / METRICS_NAME
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())["metrics"].get(name)
    except (ValueError, KeyError):
        return None
    return float(value) if value is not None else None


def logged_metrics(folder: Path) -> list[str] | None:
    """The names of the metrics in the ``metrics.json`` a fit wrote into ``folder``; None if there is none."""
    try:
        return sorted(json.loads((folder / METRICS_NAME).read_text())["metrics"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def metric_not_logged(spec: SweepSpec, logged: Sequence[str], by: str) -> str:
    """What to say when a run (``by``) finished without the sweep's metric: the names it did log, the fix."""
    names = ", ".join(logged) if logged else "nothing"
    return (
        f"metric.name {spec.metric!r} (in {spec.path}) is not logged by the model: {by} logged {names}. "
        "Set metric.name to one of them"
    )


def ranked(results: Sequence[TrialResult], spec: SweepSpec) -> list[TrialResult]:
    """Trials with a metric, best first by the spec's goal (ties keep their order), then those without."""
    scored = [r for r in results if r.metric is not None]
    scored.sort(key=lambda r: r.metric, reverse=spec.goal == "maximize")  # type: ignore[arg-type, return-value]
    return scored + [r for r in results if r.metric is None]


def results_table(results: Sequence[TrialResult], spec: SweepSpec) -> str:
    """The trials ranked by the metric, best first; failed trials last."""
    keys = list(spec.parameters)
    header = ["rank", "trial", spec.metric, *keys, "status"]
    rows = [
        [
            "-" if r.metric is None else str(i + 1),
            r.name,
            "-" if r.metric is None else f"{r.metric:.6g}",
            *[str(r.trial.get(k)) for k in keys],
            r.status,
        ]
        for i, r in enumerate(ranked(results, spec))
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


def write_results(results: Sequence[TrialResult], spec: SweepSpec, sweep_dir: Path) -> Path:
    """``results.csv`` in the sweep folder: one row per trial, best first."""
    path = sweep_dir / "results.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["trial", spec.metric, *spec.parameters, "status", "seconds"])
        for r in ranked(results, spec):
            writer.writerow([r.name, r.metric, *[r.trial.get(k) for k in spec.parameters], r.status, round(r.seconds)])
    return path
