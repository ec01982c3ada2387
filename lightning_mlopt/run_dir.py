"""The run directory: one folder per distinct configuration, the same on every relaunch of a command.

What it holds is named here and nowhere else::

    <run_dir>/
        config.yaml      the resolved configuration of the fit (config.<subcommand>.yaml for the others)
        earlier_configs/ what config.yaml said before a relaunch with other settings (1-config.yaml, ...)
        checkpoints/     FaultTolerantCheckpoint's committed checkpoints (step-<N>/ folders)
        health/          NCCLHealthCheck's hang dumps (one file per rank)
        perf/            PerformanceMonitor's summary.json, profiler traces, out-of-memory snapshots
        profile.md       the report of ``python -m lightning_mlopt profile`` (and profile.png, its chart)
        profile/         the short runs that ``profile`` measured (each its own run directory)
        metrics.json     the final metrics of each fit, written by rank zero; sweeps read it
        goodput.jsonl    GoodputLedger's events, appended by every launch (rank zero); ``goodput`` reads it
        goodput.png      the chart of ``python -m lightning_mlopt goodput``
        job.sbatch       the SLURM script, where ``slurm`` wrote it
        run.lock         held by rank zero of the live ``fit`` (one job at a time); names it while it runs
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning_mlopt.exceptions import BadInputError

DEFAULT_RUNS_ROOT = "runs"
CONFIG_NAME = "config.yaml"
RUN_DIR_PLACEHOLDER = "{run_dir}"  # in any config string, e.g. `save_dir: "{run_dir}"` for a logger
EARLIER_CONFIGS_DIR = "earlier_configs"
# The first line of every config LightningCLI saves (its dump header): a config.yaml without it is someone's own.
_SAVED_CONFIG_HEADER = "# lightning.pytorch=="
CHECKPOINTS_DIR = "checkpoints"
HEALTH_DIR = "health"
PERF_DIR = "perf"
PERF_SUMMARY_NAME = "summary.json"
PROFILE_REPORT_NAME = "profile.md"
PROFILE_CHART_NAME = "profile.png"
PROFILE_RUNS_DIR = "profile"
METRICS_NAME = "metrics.json"
GOODPUT_LEDGER_NAME = "goodput.jsonl"
GOODPUT_CHART_NAME = "goodput.png"
SBATCH_NAME = "job.sbatch"
RUN_LOCK_NAME = "run.lock"  # process/run_lock.py: never deleted or replaced, emptied when its holder ends
# Keys that say where or how to run, not what to train: they must not move the run directory.
# `performance` (PerformanceMonitor) and `goodput` (GoodputLedger) measure the run and change nothing it computes;
# `compile` (CompileModel) changes how the model's code runs, not what it trains: a run resumes with it on or off.
_VOLATILE_KEYS = frozenset(
    {
        "config",
        "run_dir",
        "ckpt_path",
        "weights_only",
        "print_config",
        "__path__",
        "performance",
        "goodput",
        "compile",
        "run_dir_wait",
    }
)


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """Eight hex digits that identify a resolved configuration, ignoring where it was launched from.

    Example::

        >>> config_fingerprint({"model": {"lr": 0.1}}) == config_fingerprint({"model": {"lr": 0.1}})
        True
    """
    payload = json.dumps(_strip(config), sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:8]


def default_run_dir(root: str | Path, config_files: Iterable[str | Path], config: Mapping[str, Any]) -> Path:
    """``<root>/<stems of the config files>-<fingerprint>``, e.g. ``runs/gpt-zero2-1a2b3c4d``."""
    stems = [Path(str(path)).stem for path in config_files]
    name = "-".join([*stems, config_fingerprint(config)]) if stems else f"run-{config_fingerprint(config)}"
    return Path(root) / name


def _strip(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _strip(item) for key, item in value.items() if key not in _VOLATILE_KEYS}
    if isinstance(value, (list, tuple)):
        return [_strip(item) for item in value]
    return value


def resolve_run_dir(config: Mapping[str, Any], config_files: Iterable[str | Path]) -> Path:
    """The run directory of a parsed config, as the CLI and the SLURM script writer both derive it.

    Its ``run_dir`` if set, else :func:`default_run_dir` under ``trainer.default_root_dir`` (or ``runs``).

    Example::

        >>> resolve_run_dir({"run_dir": "out/a"}, [])
        PosixPath('out/a')
    """
    if config.get("run_dir"):
        return Path(config["run_dir"])
    root = (config.get("trainer") or {}).get("default_root_dir") or DEFAULT_RUNS_ROOT
    return default_run_dir(root, config_files, config)


def config_name(subcommand: str | None) -> str:
    """The file a subcommand's resolved config is saved to: ``config.yaml`` for ``fit``, else ``config.<it>.yaml``."""
    return CONFIG_NAME if subcommand in (None, "fit") else f"config.{subcommand}.yaml"


def refuse_foreign_config(run_dir: Path, name: str) -> None:
    """Raise BadInputError when ``run_dir/name`` exists and was not saved by a run (a config of the user's own).

    Every launch saves its resolved config there: a hand-written file (``--run_dir`` pointing at a project folder)
    would be replaced by it.

    Example::

        refuse_foreign_config(Path("runs/gpt-1a2b3c4d"), "config.yaml")  # a run's own: fine
    """
    path = run_dir / name
    if not path.is_file():
        return
    with path.open("rb") as handle:
        first = handle.readline()
    if not first.startswith(_SAVED_CONFIG_HEADER.encode()):
        raise BadInputError(
            f"run_dir: {path} was not saved by a run (a config of your own?) and each launch saves its resolved "
            "config there; give --run_dir a folder of the run's own (e.g. runs/<name>), or move the file"
        )


def keep_earlier_config(path: Path, replacement: Path) -> Path | None:
    """Put ``replacement`` (a new save of a run's config) at ``path``; what ``path`` said, if other, is kept.

    Returns where the earlier config went: ``earlier_configs/<n>-<name>`` beside it, n counting up. A relaunch
    with other settings (a larger max_steps, a mistyped model size) must not erase what the run was.
    """
    earlier = None
    if path.is_file() and path.read_bytes() != replacement.read_bytes():
        folder = path.parent / EARLIER_CONFIGS_DIR
        folder.mkdir(exist_ok=True)
        taken = [each.name.split("-", 1)[0] for each in folder.iterdir() if each.name.endswith(f"-{path.name}")]
        number = 1 + max((int(n) for n in taken if n.isdigit()), default=0)  # after the highest, even with gaps
        earlier = folder / f"{number}-{path.name}"
        os.replace(path, earlier)
    os.replace(replacement, path)
    return earlier


def fill_run_dir(value: Any, run_dir: str) -> Any:
    """Replace ``{run_dir}`` in every string of a parsed config, in place (e.g. a logger's ``save_dir``).

    Example::

        >>> fill_run_dir({"logger": {"save_dir": "{run_dir}/logs"}}, "runs/a")
        {'logger': {'save_dir': 'runs/a/logs'}}
    """
    items = value.items() if hasattr(value, "items") else enumerate(value) if isinstance(value, list) else []
    for key, item in list(items):
        if isinstance(item, str) and RUN_DIR_PLACEHOLDER in item:
            value[key] = item.replace(RUN_DIR_PLACEHOLDER, run_dir)
        else:
            fill_run_dir(item, run_dir)
    return value
