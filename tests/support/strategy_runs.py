"""Launch the GPT demo through the real CLI on 2 CPU processes and read back what the workers recorded."""

from __future__ import annotations

import shutil
import signal
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from tests.conftest import failure_report, run_cli
from tests.support.cli_args import fit_args
from tests.support.recorders import read_records


class TrainedRun(NamedTuple):
    """What a run recorded: one dict per rank, the full parameters at the end, and its run directory."""

    records: list[dict]
    params: dict[str, torch.Tensor]
    run_dir: Path


# Deaths by a native crash, not by our code's exit paths.
_NATIVE_CRASHES = (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS)


def train(
    tmp_path: Path,
    name: str,
    strategy: str,
    steps: int,
    devices: int = 2,
    extra: tuple[str, ...] = (),
    retry_native_crash: bool = False,
) -> TrainedRun:
    """Fit ``steps`` steps with a strategy name or overlay file under ``tmp_path/runs/name``.

    What it printed is kept in ``tmp_path/name/output.txt``. ``retry_native_crash``: a run killed by a native
    crash is trained once more from scratch, with a warning that carries the crash's report (the session's shared
    runs record collectives under torch.profiler's Python tracer, a rare crash source outside what they test).

    Example::

        records, params, run_dir = train(tmp_path, "first", "fsdp", steps=3)
    """
    out, run_dir = tmp_path / name, tmp_path / "runs" / name
    args = fit_args(
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.callbacks+=tests.support.recorders.RecordEverything",
        f"--trainer.callbacks.out_dir={out}",
        *extra,
        strategy=strategy,
        devices=devices,
        steps=steps,
        run_dir=run_dir,
    )
    result = run_cli(args, cwd=tmp_path, preloaded=True)  # what training computes: imports paid once
    if retry_native_crash and result.returncode in _NATIVE_CRASHES:
        report = failure_report(result)
        warnings.warn(f"{name} crashed (exit {result.returncode}), trained again:\n{report}", stacklevel=2)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)  # from scratch: never a resume of the crashed run
        result = run_cli(args, cwd=tmp_path, preloaded=True)  # what training computes: imports paid once
    assert result.returncode == 0, f"{name} failed (exit {result.returncode}):\n{failure_report(result)}"
    (out / "output.txt").write_text(result.stdout + result.stderr)  # what the run printed, for tests to read
    return trained_run(tmp_path, name, devices)


def trained_run(tmp_path: Path, name: str, devices: int = 2) -> TrainedRun:
    """What :func:`train` returns, read back from ``tmp_path`` (a run another test worker trained)."""
    out = tmp_path / name
    records = read_records(out)
    assert [r["rank"] for r in records] == list(range(devices))
    return TrainedRun(records, torch.load(out / "params.pt"), tmp_path / "runs" / name)


def assert_same_training(run: TrainedRun, reference: TrainedRun, rank_pairs: dict[int, int]) -> None:
    """Each rank's losses (1e-4) are those of its ``rank_pairs`` rank in ``reference``; the parameters too (1e-4).

    The reference must have trained (its loss fell): agreeing on doing nothing proves nothing.
    """
    for rank, reference_rank in rank_pairs.items():
        expected = torch.tensor(reference.records[reference_rank]["losses"])
        torch.testing.assert_close(torch.tensor(run.records[rank]["losses"]), expected, rtol=1e-4, atol=0)
    assert run.params.keys() == reference.params.keys()
    for name, value in reference.params.items():
        torch.testing.assert_close(run.params[name], value, rtol=0, atol=1e-4, msg=name)
    losses = reference.records[0]["losses"]
    assert losses[-1] < losses[0], "the reference trained: agreeing on doing nothing proves nothing"
