"""Preemption signals, owned by the process from its first second to its last: record, never act, and a deadline.

A scheduler asks a job to stop with a signal to every process (SLURM's ``--signal=USR1@N`` and preemption
SIGTERM, Kubernetes' SIGTERM, a cloud's spot notice). Three facts shape how we take it:

- A signal may land at any instant, mid-collective included. Acting inside the handler (saving, or Lightning
  2.6's ``dist.broadcast`` in its SIGTERM handler) puts the ranks in different collectives and hangs the job.
  So the handler only records; FaultTolerantCheckpoint acts at the next step boundary, after every rank
  agreed, and exits with 75.
- Python runs a handler only when the main thread returns to the interpreter. A rank blocked in a C++
  collective never runs it, and with the default action replaced it would ignore every later SIGTERM
  forever. So a watcher thread reads the signal from the interpreter's wakeup file descriptor (written by
  the C-level handler at once, whatever the main thread does) and starts a deadline: if the process has not
  exited ``deadline_s`` after the signal, it prints where the main thread is and exits with ``exit_code``
  (no new checkpoint; the previous one is intact). The first rank to leave breaks its peers' collectives: an
  uncaught failure after the signal exits with the same status, so the job is requeued, not marked failed.
- A signal can arrive while the process is still importing torch and Lightning (SLURM may send it up to N
  seconds early) or waiting in the rendezvous. The entry point installs these handlers before importing
  anything slow; until the first training step a signal ends the process at once (there is nothing to save).

Only the standard library is imported here: this module loads before torch.

Example::

    from lightning_mlopt.process.signals import preemption

    preemption.install(["SIGTERM", "SIGUSR1"], deadline_s=120, exit_code=75)
    ...
    if preemption.received() is not None:   # at a step boundary, then agreed across ranks
        save_and_exit()
    preemption.release()
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from types import FrameType, TracebackType
from typing import Any

from lightning_mlopt.process import exit_codes
from lightning_mlopt.process.exit import leave_before_training
from lightning_mlopt.process.grace import ANY_SIGNAL, grace_for, signal_deadline_within

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
DEFAULT_DEADLINE_S = 120.0
REQUEUE_EXIT_CODE = exit_codes.REQUEUE


class PreemptionSignals:
    """Flag-only handlers for the preemption signals of this process, with a deadline after the first one.

    One instance per process (``preemption`` below): signal handlers and the wakeup descriptor are process-wide.
    ``install`` and ``release`` must run in the main thread; ``received`` may be called from anywhere.
    """

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}  # signal number -> the handler before ours
        self._given_back: dict[int, Any] = {}  # signal number -> the handler release() gave it back to
        self._received: int | None = None
        self._received_at = 0.0
        self._notice: str | None = None  # what raised the flag when it was not a signal (a cloud notice)
        self.deadline_s: float | None = DEFAULT_DEADLINE_S  # before a known grace moves it below
        self.graces: dict[str, float] = {}  # signal name (or "*") -> seconds from it to the forced kill
        self.exit_code = REQUEUE_EXIT_CODE
        self._lock = threading.Lock()
        self._pipe: tuple[int, int] | None = None
        self._previous_wakeup_fd = -1
        self._watcher: threading.Thread | None = None
        self._leaving = threading.Lock()  # the deadline and a failure after the signal: one of them says why
        self._hooked_excepthook: Any = None  # the hook ours replaced (None: ours is not installed)
        self._before_training = False  # the entry point's start-up: a signal ends the process at once

    # ------------------------------------------------------------------ public

    def install(
        self,
        names: Iterable[str] = DEFAULT_SIGNALS,
        deadline_s: float | None = DEFAULT_DEADLINE_S,
        exit_code: int = REQUEUE_EXIT_CODE,
        graces: Mapping[str, float] | None = None,
    ) -> list[int]:
        """Own exactly the signals ``names`` from now on; signals owned before but not named go back to theirs.

        A signal received earlier and still owned stays recorded; one received for a signal given back is
        delivered again to its own handler (by default, it ends the process as it would have).

        Args:
            names: signal names, e.g. ``["SIGTERM", "SIGUSR1"]``.
            deadline_s: seconds from a signal to a forced exit; None: no deadline.
            exit_code: the status of that forced exit.
            graces: seconds from each signal to the forced kill (``process/grace.py``: name or ``*`` -> s);
                the deadline moves below the grace of the signal that came. None: unknown.

        Returns:
            The signal numbers now owned (empty outside the main thread, where handlers cannot be set).

        """
        if threading.current_thread() is not threading.main_thread():
            return []
        wanted = {int(getattr(signal, name)) for name in names}
        self.deadline_s = deadline_s
        self.exit_code = exit_code
        self.graces = dict(graces or {})
        for number in [n for n in self._previous if n not in wanted]:
            self._give_back(number)
        for number in sorted(wanted - set(self._previous)):
            previous = signal.getsignal(number)
            if previous == self._on_signal:  # ours, where Lightning's teardown put it back after a release
                previous = self._given_back.get(number, signal.SIG_DFL)
            self._previous[number] = previous
            signal.signal(number, self._on_signal)
        if self._previous:
            self._start_watcher()
            self._wake_watcher()  # a signal already received: its deadline may have moved (a grace now known)
            self._hook_uncaught_exceptions()
        return sorted(self._previous)

    def own_for_run(
        self,
        trainer: Any,
        names: Iterable[str],
        deadline_s: float | None,
        exit_code: int,
        graces: Mapping[str, float] | None,
    ) -> list[int]:
        """:meth:`install` ``names`` for a Trainer's run, and keep Lightning's own handlers off them.

        Lightning registers its SIGTERM (and, under SLURM, SIGUSR1) handlers in ``Trainer._run`` after the
        callbacks' ``setup``; they run collectives inside the handler. With SIGTERM ours, Lightning's per-batch
        broadcast of its SIGTERM flag is skipped too (a collective every step for a flag nothing sets). A signal
        that came before this (the entry point owns them from its first second) stays recorded and is acted on at
        the first step boundary.
        """
        names = list(names)
        if threading.current_thread() is not threading.main_thread():
            return []
        if not names:  # the config wants none: what the entry point took from its first second goes back
            self.release()
            return []
        from lightning_mlopt._compat import keep_lightning_off_signals, skip_per_batch_sigterm_broadcast

        owned = self.install(names, deadline_s=deadline_s, exit_code=exit_code, graces=graces)
        keep_lightning_off_signals(trainer, owned)
        if signal.SIGTERM in owned:  # Lightning's flag can no longer be raised: its per-batch broadcast is waste
            skip_per_batch_sigterm_broadcast(trainer)
        return owned

    def received(self) -> int | None:
        """The first owned signal this process received, or None."""
        return self._received

    def describe(self) -> str:
        """What raised the flag, for messages: ``SIGTERM``, or the notice (``an AWS spot notice``)."""
        return self._notice or self._received_name() or "no signal"

    @property
    def grace_s(self) -> float | None:
        """The grace of the signal received (before one: of any signal), or None when unknown."""
        return grace_for(self.graces, self._received_name() or ANY_SIGNAL)

    def _received_name(self) -> str | None:
        return signal.Signals(self._received).name if self._received else None

    def current_deadline_s(self) -> float | None:
        """Seconds from the signal received to the last-resort exit: ``deadline_s``, below its grace."""
        return signal_deadline_within(self.deadline_s, self.grace_s)

    def seconds_left(self) -> float | None:
        """Seconds until the forced kill after the flag was raised; None with no flag or no known grace."""
        if self._received is None or self.grace_s is None:
            return None
        return self._received_at + self.grace_s - time.monotonic()

    def notify(self, description: str, seconds_left: float) -> None:
        """Raise the flag as a SIGTERM would, for a preemption that is not a signal (a cloud's spot notice).

        Safe from any thread. The notice's deadline becomes the grace when it is the shorter; the last-resort
        deadline moves below it. Never delivered again at ``release`` (no signal came).
        """
        with self._lock:
            if self._received is not None:
                return
            self._received, self._received_at = int(signal.SIGTERM), time.monotonic()
            self._notice = description
            known = grace_for(self.graces, "SIGTERM")
            self.graces["SIGTERM"] = seconds_left if known is None else min(known, seconds_left)
        self._wake_watcher()  # its deadline starts now

    def _wake_watcher(self) -> None:
        """Make the watcher compute its deadline again (a zero byte: no signal number)."""
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self._pipe[1], b"\0")

    def owned(self) -> list[int]:
        """The signal numbers whose handler is ours."""
        return sorted(self._previous)

    def release(self) -> None:
        """Give every signal back to its previous handler, stop the watcher, and forget what was received.

        A signal received and never acted on (e.g. during ``validate``, which saves nothing) is delivered again
        to its previous handler, so the process ends as it would have without us.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        if self._before_training and self._received is not None:
            # Received in start-up; a peer's exit broke a collective here before the watcher acted: 75 at once,
            # never a redelivery ending the rank by the signal (srun: "User defined signal 1", no requeue).
            self._leaving.acquire()  # the watcher may hold it: then it is ending the process already
            leave_before_training(self.describe(), self.exit_code)
        for number in list(self._previous):
            self._give_back(number)
        self._stop_watcher()
        self._received = None
        self._notice = None

    def end_at_once_before_training(self) -> None:
        """Until :meth:`training_started`, a signal ends the process at once: start-up has nothing to save."""
        self._before_training = True
        self._wake_watcher()  # a signal already received

    def training_started(self) -> None:
        """The first training step begins: from here a signal is saved at a step boundary."""
        self._before_training = False

    def acknowledge(self) -> None:
        """The signal was acted on (saved, exiting): release() must not deliver it again."""
        with self._lock:
            self._pending_redelivery = False

    # ------------------------------------------------------------------ handlers

    _pending_redelivery = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a record: anything more could interrupt a collective or a half-written tensor.
        if signum not in self._previous:
            # Given back, yet ours again: Lightning's teardown restores the handlers it found at its registration,
            # ours among them. The signal goes where it was given back to (by default, it ends the process).
            signal.signal(signum, self._given_back.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        self._record(signum)

    def _record(self, signum: int) -> None:
        with self._lock:
            if self._received is None and signum in self._previous:
                self._received = signum
                self._received_at = time.monotonic()
                self._pending_redelivery = True

    def _give_back(self, number: int) -> None:
        previous = self._previous.pop(number)
        self._given_back[number] = previous if previous is not None else signal.SIG_DFL
        signal.signal(number, self._given_back[number])
        if self._received == number and self._pending_redelivery:
            self._received = None
            self._pending_redelivery = False
            os.kill(os.getpid(), number)  # delivered now, to the handler the process had without us

    # ------------------------------------------------------------------ failures after a signal

    def _hook_uncaught_exceptions(self) -> None:
        """Chain :meth:`_uncaught` in front of ``sys.excepthook``, once (inert while no signal is owned)."""
        if self._hooked_excepthook is None:
            self._hooked_excepthook = sys.excepthook
            sys.excepthook = self._uncaught

    def _uncaught(self, kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        """A failure that ends the process after a preemption signal ends it as preempted, not as a crash.

        Every rank of a preempted job receives the signal; the first to reach its deadline leaves, and the others'
        collectives then fail ("Connection closed by peer"). Exiting 1 there would turn a requeue into a failed
        job (a job's status is rank zero's): the process exits with the deadline's status and says why.
        """
        if self._received is None or not self._previous:
            self._hooked_excepthook(kind, error, trace)
            return
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        waited = time.monotonic() - self._received_at
        self._leave(
            f"error: received {self.describe()} {waited:.0f} s ago; then the main thread failed ({kind.__name__}: "
            f"{first_line}), most likely because another rank reached its deadline and left a collective. "
            f"Exiting with status {self.exit_code} without a new checkpoint; earlier ones are intact.\n"
        )

    def _leave(self, message: str) -> None:
        """Write ``message`` to the process's stderr and exit with ``exit_code`` at once; the first caller wins.

        Written to descriptor 2, not ``sys.stderr``: torch's rank-prefixing excepthook swaps ``sys.stderr`` for a
        buffer while the hook it wraps runs, and a message written there is lost at ``os._exit``.
        """
        self._leaving.acquire()  # a second caller waits here until the first one's exit ends the process
        data = message.encode(errors="replace")
        with contextlib.suppress(OSError):
            while data:
                data = data[os.write(2, data) :]
        self._let_the_launcher_go_first()
        os._exit(self.exit_code)

    def _let_the_launcher_go_first(self) -> None:
        """A rank that Lightning's launcher started waits until the launching rank has exited (bounded).

        The launcher SIGKILLs itself when it sees a child exit non-zero: a child that leaves first makes the job's
        status 137 instead of the agreed one, and a requeue never happens. The launching rank is at its own
        deadline or past it; the wait ends before the signal's grace does.
        """
        from lightning_mlopt.process import launcher

        if launcher.started_by_lightning_launcher():
            left, limit = self.seconds_left(), launcher.LAUNCHER_WAIT_S
            launcher.wait_for_parent_to_exit(limit if left is None else min(limit, max(0.0, left - 1.0)))

    # ------------------------------------------------------------------ watcher

    def _start_watcher(self) -> None:
        if self._watcher is not None:
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # required by set_wakeup_fd: a full pipe must never block a handler
        try:
            self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter: handlers alone will do
            os.close(read_fd)
            os.close(write_fd)
            return
        self._pipe = (read_fd, write_fd)
        self._watcher = threading.Thread(target=self._watch, args=(read_fd,), name="preemption-watcher", daemon=True)
        self._watcher.start()

    def _stop_watcher(self) -> None:
        if self._pipe is None:
            return
        read_fd, write_fd = self._pipe
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.close(write_fd)  # the watcher reads end-of-file and returns
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        os.close(read_fd)
        self._pipe = None
        self._watcher = None

    def _watch(self, read_fd: int) -> None:
        """Record signals the moment they arrive, and enforce the deadline after the first one."""
        while True:
            timeout = self._seconds_left()
            if timeout is not None and timeout <= 0:
                self._expire()
                return
            try:
                ready, _, _ = select.select([read_fd], [], [], timeout)
            except (OSError, ValueError):
                return
            if not ready:
                continue
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:  # release() closed the write end
                return
            for number in data:
                self._record(number)
            if self._before_training and self._received is not None:  # the main thread may block for minutes
                self._leaving.acquire()  # the one exit that speaks: failures it causes meanwhile stay quiet
                leave_before_training(self.describe(), self.exit_code)

    def _seconds_left(self) -> float | None:
        deadline = self.current_deadline_s()
        if self._received is None or deadline is None:
            return None
        return self._received_at + deadline - time.monotonic()

    def _expire(self) -> None:
        """The process did not stop in time after a signal: say where it is stuck, then exit."""
        from lightning_mlopt.process import phase  # stdlib-only module

        name = self.describe()
        step_phase, step, in_phase = phase.current()
        stack = phase.main_thread_stack()
        waited = self.current_deadline_s() or 0.0
        self._leave(
            f"error: received {name} {waited:.0f} s ago and did not reach a step boundary to save and exit "
            f"(step {step}, phase '{step_phase}' for {in_phase:.0f} s; most likely waiting in a collective for "
            f"another rank). Exiting with status {self.exit_code} without a new checkpoint; earlier ones are "
            f"intact. Main thread:\n{stack}"
        )


preemption = PreemptionSignals()
"""The process's one owner of the preemption signals."""
