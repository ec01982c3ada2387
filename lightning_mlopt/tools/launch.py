"""``python -m lightning_mlopt launch [torchrun's options] SUBCOMMAND ...``: torchrun, with preemption done right.

torchrun's launcher (its options, its elastic agent, ``--max-restarts``) runs in this process, and the job's
preemption signals are ours: SIGTERM, SIGUSR1 and SIGINT are forwarded to every worker, the launcher waits
for them up to the grace (torchrun's ``--shutdown-timeout``, which the workers are told, so their signal save
fits in it), and it ends with one line and a status a scheduler can act on:

- the workers ended preempted: the preemption status (75; ``--preempted-exit-code`` for schedulers that
  retry only other codes), naming the committed checkpoint a relaunch resumes from;
- the workers finished: 0;
- a worker failed: that worker's own status (74, 2, 1, ...), never a traceback for a signal.

Kubernetes sends SIGTERM to a container's PID 1 alone, which bash does not forward: run ``exec python -m
lightning_mlopt launch ...`` as the container's command (what ``python -m lightning_mlopt k8s`` writes).
On a spot VM the launcher also polls the cloud's preemption notices (``--preemption-notices``) and treats
one as a SIGTERM.

Example::

    python -m lightning_mlopt launch --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d
        --rdzv-endpoint=node0:29400 --rdzv-id=run1 fit --config configs/gpt.yaml
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mlopt.cli.commands import TRAINER_RUNS
from lightning_mlopt.process import exit_codes
from lightning_mlopt.process.grace import GRACE_ENV, graces_from_environment
from lightning_mlopt.process.launch_report import DEADLINE_NAME, LAUNCHER_PID_ENV, REPORTS_ENV, read_reports
from lightning_mlopt.process.notices import NOTICES_BY_LAUNCHER_ENV, NoticePoller, providers_for
from lightning_mlopt.tools._preamble import ToolArgumentParser, bad_input

PROG = "python -m lightning_mlopt launch"
FORWARDED = ("SIGTERM", "SIGUSR1", "SIGINT")  # a scheduler's preemption signals, and Ctrl-C
DEFAULT_SHUTDOWN_TIMEOUT_S = 30  # torchrun's own default: SIGKILL 30 s after forwarding the signal


class _Signals:
    """The launcher's signals: the first stops torchrun's agent (which forwards it and waits); later ones only count.

    A second SIGTERM (a notice, then the kubelet's) must neither restart torchrun's wait nor raise in the middle
    of the launcher's own summary.
    """

    def __init__(self) -> None:
        self.received: int | None = None

    def first(self, signum: int) -> bool:
        """Record ``signum``; whether it is the first signal."""
        if self.received is not None:
            return False
        self.received = signum
        return True

    def record(self, signum: int, frame: Any) -> None:
        self.first(signum)

    def own(self) -> None:
        """Record the forwarded signals from now on (main thread only, where handlers can be set)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in FORWARDED:
            signal.signal(getattr(signal, name), self.record)

    def raise_in_agent(self) -> None:
        """From now on the first signal stops torchrun's agent the way its own handler does.

        Before the workers start (rendezvous) our handler raises torchrun's exception; once they started,
        torchrun's own handler does, after telling us (and only for the first signal).
        """
        from torch.distributed.elastic.multiprocessing.api import SignalException

        from lightning_mlopt._compat import route_torchrun_signals

        def stop(signum: int, frame: Any) -> None:
            if self.first(signum):
                raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

        route_torchrun_signals(self.first)
        if threading.current_thread() is not threading.main_thread():
            return
        for name in FORWARDED:
            signal.signal(getattr(signal, name), stop)


def _parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = ToolArgumentParser(
        prog=PROG,
        description="torchrun, with preemption signals forwarded, a grace, and exit 75 when preempted.",
        epilog=f"SUBCOMMAND is one of {', '.join(TRAINER_RUNS)}; what follows it goes to the subcommand.",
        parents=[get_args_parser()],
        conflict_handler="resolve",
    )
    parser.add_argument(
        "--preempted-exit-code",
        "--preempted_exit_code",
        type=int,
        default=exit_codes.REQUEUE,
        help="status when the workers ended preempted (default 75; 143 for Kubeflow PyTorchJob v1's ExitCode policy)",
    )
    parser.add_argument(
        "--preemption-notices",
        "--preemption_notices",
        default="auto",
        help="cloud preemption notices polled by the launcher: auto (this VM's cloud), off, or aws,gce",
    )
    return parser


def _torchrun_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """Torchrun's options for running ``python -m lightning_mlopt SUBCOMMAND ...`` with our signal settings."""
    options = _parser().parse_args(list(argv))
    subcommand = options.training_script
    if subcommand not in TRAINER_RUNS:
        raise ValueError(
            f"launch runs a Trainer subcommand ({', '.join(TRAINER_RUNS)}), got {subcommand!r}; "
            f"e.g. {PROG} --nproc-per-node=2 fit --config configs/gpt.yaml"
        )
    if options.module or options.no_python or options.run_path:
        raise ValueError("launch runs `python -m lightning_mlopt` itself: drop -m/--module, --no-python, --run-path")
    _check_nproc_per_node(options.nproc_per_node)
    if not 0 < options.preempted_exit_code < 256:
        raise ValueError(f"--preempted-exit-code must be in 1..255, got {options.preempted_exit_code}")
    providers_for(options.preemption_notices)  # a bad name is bad input
    options.training_script_args = [subcommand, *options.training_script_args]
    options.training_script, options.module = "lightning_mlopt", True
    handled = [name.strip() for name in options.signals_to_handle.split(",") if name.strip()]
    options.signals_to_handle = ",".join(dict.fromkeys([*handled, *FORWARDED]))
    if options.shutdown_timeout is None:
        options.shutdown_timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT_S))
    if options.shutdown_timeout < 1:
        raise ValueError(f"--shutdown-timeout must be >= 1 s (the workers' grace), got {options.shutdown_timeout}")
    return options


def _check_nproc_per_node(value: str) -> None:
    """A count of workers, or a device kind torchrun counts; torchrun fails on others with a traceback, not a line.

    Raises:
        ValueError: naming the option and what it takes.

    """
    import torch

    kinds = ["auto", "cpu", "gpu", "xpu"]
    if value in kinds or (value.isdigit() and int(value) >= 1):
        return
    accelerator = torch.accelerator.current_accelerator()  # torchrun also takes a plug-in device's name (npu, ...)
    if accelerator is not None and value == accelerator.type:
        return
    raise ValueError(
        f"--nproc-per-node must be a number of workers >= 1, or one of {', '.join(kinds)}; got {value!r} "
        "(e.g. --nproc-per-node=2)"
    )


def _worker_environment(options: argparse.Namespace, reports: str) -> None:
    """What the workers inherit: the grace they have, where to report, and torchrun's store settings."""
    # A grace announced to the launcher itself (e.g. by an sbatch script), for the shortest-lived of its signals.
    outer = min(graces_from_environment().values(), default=None)
    grace = float(options.shutdown_timeout) if outer is None else min(outer, float(options.shutdown_timeout))
    os.environ[GRACE_ENV] = f"{grace:g}"
    os.environ[REPORTS_ENV] = reports
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ[NOTICES_BY_LAUNCHER_ENV] = "1"  # the workers leave the polling to the launcher, once per node
    # The workers' own TCP store, not the rendezvous one: an agent restart then never finds a stale store.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"


class _QuietAfterSignal(logging.Filter):
    """torchrun logs each step of its shutdown; after a preemption signal the launcher's one line says it all."""

    def __init__(self, signals: _Signals) -> None:
        super().__init__()
        self.signals = signals

    def filter(self, record: logging.LogRecord) -> bool:
        return self.signals.received is None or record.levelno >= logging.CRITICAL


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m lightning_mlopt launch``; returns the exit status."""
    signals = _Signals()
    signals.own()  # before torch is imported: a signal during start-up is remembered, not fatal
    try:
        options = _torchrun_arguments(argv)
    except ValueError as error:
        return bad_input(error)
    with tempfile.TemporaryDirectory(prefix="mlopt-launch-") as reports:
        _worker_environment(options, reports)
        quiet = _QuietAfterSignal(signals)
        for name in ("", "torch", "torch.distributed", "torch.distributed.elastic"):  # where its records end up
            for handler in logging.getLogger(name).handlers:
                handler.addFilter(quiet)
        return _run(options, signals, reports)


def _run(options: argparse.Namespace, signals: _Signals, reports: str) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from lightning_mlopt._compat import signal_workers_not_their_children

    signal_workers_not_their_children()
    signals.raise_in_agent()
    if signals.received is not None:  # during start-up, before any worker: nothing to save
        return _say(options.preempted_exit_code, f"{_name(signals.received)} before the workers started")
    poller = _poll_notices(options, reports)
    ended: Exception | None = None
    try:
        run(options)
    except Exception as error:  # a signal, a failed worker, torchrun's own errors (rendezvous timeouts, ...)
        ended = signal_behind(error)
    finally:
        signals.own()  # from here a signal is recorded, not raised: the outcome is already known
        if poller is not None:
            poller.stop()
    if ended is None:
        return exit_codes.SUCCESS
    if isinstance(ended, SignalException):
        return _after_preemption(options, f"preempted by {_name(int(ended.sigval))}", read_reports(reports))
    if isinstance(ended, ChildFailedError):
        found = read_reports(reports)
        if any(report.get("preempted") for report in found.values()):  # another node's launcher was signalled
            return _after_preemption(options, "preempted (the signal reached another node)", found)
        rank, failure = ended.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode  # -9 -> 137, as a shell says
        return _say(code, f"worker rank {rank} exited with status {code}; its output is above")
    return _say(exit_codes.FAILURE, f"{type(ended).__name__}: {ended}")


def signal_behind(error: Exception) -> Exception:
    """The torchrun signal exception that ``error`` hides in its context chain, else ``error`` itself.

    torchrun's metrics wrapper (``torch.distributed.elastic.metrics.api.prof``, around the agent's monitor
    loop) assigns ``start = time.time()`` inside its ``try`` and reads it in ``finally``: a signal whose handler
    raises right after ``time.time()`` returns makes the ``finally`` raise UnboundLocalError, with the signal's
    exception as its context. Seen in CI: a preempted launch ended with status 1 instead of 75.

    Example::

        >>> signal_behind(RuntimeError("rendezvous timed out"))
        RuntimeError('rendezvous timed out')
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, SignalException):
            return cause
        cause = cause.__context__
    return error


def _after_preemption(options: argparse.Namespace, cause: str, reports: dict[int, dict[str, Any]]) -> int:
    """The launcher's one line after a preemption: what the workers did, and what a relaunch resumes from."""
    statuses = [report.get("status") for report in reports.values()]
    if statuses and all(status == exit_codes.SUCCESS for status in statuses):
        return _say(exit_codes.SUCCESS, f"{cause} as the run finished; it finished")
    failed = [
        report["status"]
        for report in reports.values()
        if report.get("status") not in (None, exit_codes.SUCCESS) and not report.get("preempted")
    ]
    if failed:
        return _say(failed[0], f"{cause}, and a worker then failed with status {failed[0]}; its output is above")
    if not reports:
        told = "no worker had started its run; a relaunch resumes from the newest committed checkpoint, if any"
        return _say(options.preempted_exit_code, f"{cause}: {told}")
    first = reports[min(reports)]  # this node's lowest rank (rank 0 on the first node)
    resume = first.get("resume_from")
    if resume:
        redo = first.get("redo_steps") or 0
        what = "saved" if redo == 0 else f"had no time to save; {redo} step(s) will be redone"
        told = f"the workers {what}; a relaunch resumes from {resume}"
    else:
        stopped = any(report.get("preempted") for report in reports.values())
        how = "stopped" if stopped else f"did not stop within {options.shutdown_timeout} s and were killed"
        newest = _newest_committed(first.get("checkpoints"))
        told = f"the workers {how}; a relaunch resumes from {newest or 'the start (nothing was committed)'}"
    return _say(options.preempted_exit_code, f"{cause}: {told}")


def _newest_committed(folder: str | None) -> str | None:
    if not folder:
        return None
    from lightning_mlopt.checkpoint.store import CheckpointStore

    committed = CheckpointStore(Path(folder)).committed()
    return str(committed[-1][1]) if committed else None


def _poll_notices(options: argparse.Namespace, reports: str) -> NoticePoller | None:
    """Poll the cloud's notices here, once per node; a notice is a SIGTERM to this launcher.

    The notice's deadline is written where the workers read it (``launch_report.announced_seconds_left``): it
    may be shorter than the shutdown timeout they were told.
    """
    providers = providers_for(options.preemption_notices)
    if not providers:
        return None

    def as_sigterm(description: str, seconds_left: float) -> None:
        deadline = Path(reports) / DEADLINE_NAME
        deadline.with_suffix(".tmp").write_text(f"{time.time() + seconds_left:.3f}")
        deadline.with_suffix(".tmp").replace(deadline)
        sys.stderr.write(f"launch: {description}: {seconds_left:.0f} s left; stopping the workers\n")
        os.kill(os.getpid(), signal.SIGTERM)

    return NoticePoller(providers, as_sigterm).start()


def _name(signum: int) -> str:
    return signal.Signals(signum).name


def _say(code: int, what: str) -> int:
    sys.stderr.write(f"launch: {what} (exit {code}).\n")
    sys.stderr.flush()
    return code
