"""How a ``python -m lightning_mlopt`` rank leaves: with the status every rank agreed on, and no abort on the way out.

Three facts shape it. Lightning's launcher SIGKILLs itself when it sees a child exit non-zero (which would turn
rank zero's status, the job's, into 137), so launched ranks wait for it to go first. A gloo group still alive
at interpreter exit can abort the process ("terminate called without an active exception": -6 instead of our
status), so the group is destroyed first. And even then a communication thread can be joinable when C++
destructors run, so a multi-process rank runs the exit handlers itself and leaves without them.

Standard library only at import (torch is imported inside :func:`shut_down_process_group`, which only runs
once a Trainer has run).

Example::

    from lightning_mlopt.process.exit import exit_after_launcher

    exit_after_launcher(75)   # every rank agreed to stop after a preemption signal
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import NoReturn

from lightning_mlopt._compat import run_exit_handlers
from lightning_mlopt.process import exit_codes, launch_report
from lightning_mlopt.process.launcher import LAUNCHER_WAIT_S, started_by_lightning_launcher, wait_for_parent_to_exit
from lightning_mlopt.process.startup import startup_guard


def exit_after_launcher(code: int | str | None) -> NoReturn:
    """Exit with ``code``; a rank started by Lightning's launcher first lets the launching rank exit.

    Every rank exits with the same agreed status (75 after a signal, 74 after a failed write). Lightning's
    launcher kills itself with SIGKILL as soon as it sees a child exit non-zero, which would replace rank
    zero's status (the job's) with 137; so a child exits only after its launcher is gone (30 s at most).
    """
    status = code if isinstance(code, int) else exit_codes.FAILURE
    launch_report.write(status=status)
    launch_report.tell_launcher_if_preempted()
    # Every rank agreed on this exit, so none is in a collective: leave the process group now. A gloo group
    # still alive at interpreter exit aborts the process ("terminate called without an active exception",
    # status -6 instead of ours), as 3 of 50 torture trials showed.
    with_peers = shut_down_process_group(wait_for_peers=False)
    wait_for_launcher()
    if with_peers or _abandoned_writes():
        leave_without_destructors(status)
    raise SystemExit(code) from None


def wait_for_launcher(limit_s: float = LAUNCHER_WAIT_S) -> None:
    """A rank started by Lightning's launcher waits (``limit_s`` at most) until the launching rank has exited.

    Lightning's launcher SIGKILLs itself (rank zero, whose status is the job's) as soon as it sees a child
    exit non-zero; a child that leaves first turns the job's status into 137 (-9) whatever it agreed on.
    Elsewhere (rank zero, torchrun, srun) this returns at once.
    """
    if not started_by_lightning_launcher():
        return
    startup_guard.stop()  # its parent watch would end this process with another status
    wait_for_parent_to_exit(limit_s)


def exit_hung_rank(code: int) -> NoReturn:
    """End a rank whose watchdog named a hang: at once, except that a launched rank lets its launcher go first.

    The other ranks are stuck with this one and their watchdogs fire within a poll of it (they finished the
    same last step), or their collective fails once the launching rank has gone; either way they end as a
    hang with their own dump. Leaving first, a launched rank would have the launcher SIGKILL rank zero before
    it wrote its dump, and the job end with -9 instead of the hang's status (1 run in 2 of a stray
    ``all_gather`` on rank 1). ``os._exit``: the main thread is stuck in a collective and cannot unwind.
    """
    wait_for_launcher()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_before_training(signal_name: str, code: int) -> NoReturn:
    """End a rank preempted before its first training step, now: there is nothing to save (the signal watcher).

    One line, the report ``launch`` reads (preempted, ``code``), and a launched rank lets its launcher go first.
    ``os._exit``: the main thread may be importing, in the rendezvous or loading a checkpoint for minutes, and
    leaving from any of them loses nothing that a kill would not (every write of a run is atomic).
    """
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or os.environ.get("LOCAL_RANK")
    line = (
        f"{f'rank {rank}: ' if rank else ''}preemption ({signal_name}) before the first training step: nothing to "
        f"save; exiting with status {code}, a relaunch resumes from the newest committed checkpoint, if any\n"
    ).encode()
    with contextlib.suppress(OSError):  # descriptor 2: the exit must not wait on a buffered sys.stderr
        while line:
            line = line[os.write(2, line) :]
    with contextlib.suppress(Exception):  # a report is a courtesy: it must never keep this process alive
        launch_report.note(preempted=True)
        launch_report.write(status=code)
        launch_report.tell_launcher_if_preempted()
    wait_for_launcher()
    os._exit(code)


_ABANDONED: list[threading.Thread] = []


def abandon_at_exit(thread: threading.Thread) -> None:
    """``thread`` (a background checkpoint write a preempted rank gave up on) must not hold the process's exit."""
    _ABANDONED.append(thread)


def _abandoned_writes() -> bool:
    """A write abandoned after a preemption is still running.

    The interpreter would wait for it at exit (writer threads are not daemons, so a normal exit never cuts a
    write off); after an abandon that wait is what the grace has no room for. Its staging folder is never
    committed, so leaving now loses nothing that was committed.
    """
    return any(thread.is_alive() for thread in _ABANDONED)


def leave_without_destructors(code: int) -> NoReturn:
    """Exit a multi-process run's rank with ``code`` after its process group is destroyed.

    Even with the group destroyed, a communication thread can still be joinable when the interpreter's C++
    destructors run, and abort the process ("terminate called without an active exception", -6 instead of
    ``code``): 1 of 12 FSDP full-disk torture trials after an agreed exit, 1 of 20 ZeRO-3 relaunches after a
    run that had finished. Run the exit handlers (W&B's flush, the journal) ourselves, then leave without
    those destructors.
    """
    run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shut_down_process_group(wait_for_peers: bool = True) -> bool:
    """Destroy the process group; after a successful run, first wait for every rank.

    Lightning leaves it alive. A rank that exits while another is still in a collective tears the
    connection down under it, and gloo's thread then aborts that process ("terminate called without an
    active exception") after a run that succeeded. ``wait_for_peers=False`` after an agreed exit (no rank is
    in a collective, and a barrier could wait on a rank that is gone).

    Returns:
        Whether the group had other ranks.

    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    others = dist.get_world_size() > 1
    if wait_for_peers:
        dist.barrier()
    dist.destroy_process_group()
    return others
