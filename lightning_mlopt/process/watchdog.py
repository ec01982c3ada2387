"""A per-process hang watchdog: when no step finishes in time, dump every thread's stack and exit."""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from lightning_mlopt._compat import current_frames
from lightning_mlopt.process import phase
from lightning_mlopt.process.exit import exit_hung_rank
from lightning_mlopt.process.startup import StartupGuard, startup_guard

log = logging.getLogger(__name__)

DUMP_WAIT_S = 45.0
"""How long a thread about to exit waits for another thread's dump in progress (a slow disk, the ranks' line)."""

DESCRIBE_WAIT_S = 15.0
"""The most the report's first line (which collective each rank is in, read through the store) may take."""


class HangWatchdog:
    """A daemon thread that ends the process when no step has finished for ``timeout()`` seconds.

    Before exiting it writes every thread's Python stack to ``dump_dir/hang-rank<R>.txt``, naming the step and
    the phase last entered, so the culprit is on disk even when the job is killed; then the line ``describe``
    gives (which collective each rank is in), and a short form to the console.

    Every rank's watchdog fires at about the same moment (the ranks waiting in a collective time out with
    the one that hung). When the launching rank exits first, a launched rank ends as an orphan (see
    :mod:`lightning_mlopt.process.startup`), possibly before its own watchdog looked; so the watchdog also
    leaves its dump as the orphan's last words when its step has run for half its limit or more. And when the
    rank that hung exits first, the ranks waiting for it see their collective fail ("connection closed by
    peer") before their own watchdog looks: :meth:`exit_if_stuck` lets them end as a hang too, dump and status.

    Args:
        timeout: returns the current limit in seconds (fixed, or adaptive to the steps seen).
        dump_dir: folder for the stack dumps.
        rank: this process's global rank (for the file name and the message).
        exit_code: exit status; distinctive, so a launcher and a human can tell a hang from a crash.
        poll_seconds: how often the thread looks.
        exit_process: ends the process (:func:`~lightning_mlopt.process.exit.exit_hung_rank`: a launched rank
            lets its launcher exit first; tests record the status instead).
        guard: the start-up guard whose orphan exit writes the dump first (the process's own).
        describe: returns the report's first line (which collective each rank is in, from the collective
            recorder), or None; called from the watchdog's thread when it fires, and never allowed to fail it.

    Example::

        watchdog = HangWatchdog(lambda: 600.0, Path("runs/x/health"), rank=0, exit_code=124)
        watchdog.start()
        ...
        watchdog.beat()   # after every finished step
        watchdog.stop()

    """

    def __init__(
        self,
        timeout: Callable[[], float],
        dump_dir: Path,
        rank: int,
        exit_code: int,
        poll_seconds: float = 0.5,
        exit_process: Callable[[int], None] = exit_hung_rank,
        guard: StartupGuard = startup_guard,
        describe: Callable[[], str | None] | None = None,
    ) -> None:
        self.timeout = timeout
        self.dump_dir = dump_dir
        self.rank = rank
        self.exit_code = exit_code
        self.poll_seconds = poll_seconds
        self._exit_process = exit_process
        self._guard = guard
        self._describe = describe
        self._dump_once = threading.Lock()  # the watchdog's own report and the orphan's last words may coincide
        self._dump_written = threading.Event()
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching (the clock starts now)."""
        self._last_beat = time.monotonic()
        # A daemon: it must never keep a finished process alive.
        self._thread = threading.Thread(target=self._watch, name=f"hang-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()
        self._guard.add_last_words(self.dump_if_stuck)

    def beat(self) -> None:
        """A step finished."""
        self._last_beat = time.monotonic()

    def stop(self) -> None:
        """Stop watching and wait for the thread."""
        self._guard.remove_last_words(self.dump_if_stuck)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            waited = time.monotonic() - self._last_beat
            limit = self.timeout()
            if waited > limit:
                self._report_and_exit(waited, limit)
                return

    def dump_if_stuck(self, reason: str) -> bool:
        """Write the dump now if the current step has run for half the limit or more (the process is ending).

        ``reason`` says why it ends, e.g. "the process that launched this rank (pid 812) is gone". Returns
        whether the step was stuck (and so the dump written).
        """
        waited, limit = time.monotonic() - self._last_beat, self.timeout()
        if waited < limit / 2:
            return False
        self._write_dump(f"HANG on rank {self.rank}: {self._when(waited, limit)}; {reason}, so this rank exits")
        return True

    def exit_if_stuck(self, reason: str) -> None:
        """End the process as a hang (dump, then ``exit_code``) if the current step has run for half the limit.

        For a rank whose collective failed because the rank that hung has exited already: without this it would
        end as an ordinary crash (status 1, no dump) a moment before its own watchdog named the hang.
        """
        if self.dump_if_stuck(reason):
            self._exit_process(self.exit_code)

    def _report_and_exit(self, waited: float, limit: float) -> None:
        self._write_dump(
            f"HANG on rank {self.rank}: {self._when(waited, limit)}; exiting with status {self.exit_code}."
        )
        self._exit_process(self.exit_code)

    @staticmethod
    def _when(waited: float, limit: float) -> str:
        name, step, in_phase = phase.current()
        return (
            f"no training step finished for {waited:.0f} s (limit {limit:.0f} s); "
            f"last step {step}, phase '{name}' entered {in_phase:.0f} s ago"
        )

    def _write_dump(self, header: str) -> None:
        if not self._dump_once.acquire(blocking=False):
            # Another thread is writing it: wait for the file before this one goes on to exit the process,
            # or the exit would cut the dump short (the orphan's last words and the watchdog firing together).
            self._dump_written.wait(DUMP_WAIT_S)
            return
        try:
            # The stacks first, on disk at once: the line that names the collectives waits for the other ranks
            # (through the store), and the launcher may end this process meanwhile.
            stacks = _format_stacks()
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            path = self.dump_dir / f"hang-rank{self.rank}.txt"
            with path.open("w") as handle:
                handle.write(f"{header}\n\n{stacks}\n\nfaulthandler view (includes threads in C):\n")
                handle.flush()
                faulthandler.dump_traceback(handle, all_threads=True)
            lead = self._lead_line()
            body = path.read_text()
            path.write_text(body.replace(f"{header}\n", f"{header}\n{lead}\n", 1))
            # The console gets the verdict and where this thread stands; every thread's stack is in the file.
            short = f"{header}\n{lead}\n{_innermost(CONSOLE_FRAMES)}(every thread's stack: {path})\n"
            log.debug("%s", short)
            sys.stderr.write(short)
            sys.stderr.flush()
        finally:
            self._dump_written.set()

    def _lead_line(self) -> str:
        """The collectives line, waited for at most ``DESCRIBE_WAIT_S`` (a store that stopped answering)."""
        if self._describe is None:
            return "collectives: not recorded (add CollectiveSequenceCheck to name what each rank waits in)"
        answer: list[str] = []

        def ask() -> None:
            try:
                line = self._describe() if self._describe is not None else None
                answer.append(f"collectives: {line}" if line else "collectives: not recorded in this run")
            except Exception as error:  # a report that fails must not stop the dump and the exit
                answer.append(f"collectives: could not be compared ({error!r})")

        asking = threading.Thread(target=ask, name=f"hang-describe-rank{self.rank}", daemon=True)
        asking.start()
        asking.join(DESCRIBE_WAIT_S)
        return answer[0] if answer else f"collectives: no answer from the other ranks in {DESCRIBE_WAIT_S:g} s"


CONSOLE_FRAMES = 4
"""Frames of the stuck thread printed to the console (innermost last); the file has every thread's whole stack."""


def _innermost(frames: int) -> str:
    """The main thread's innermost ``frames`` frames, formatted (where a hung rank's training thread stands)."""
    main = threading.main_thread().ident
    frame = current_frames().get(main) if main is not None else None
    if frame is None:
        return ""
    return "Main thread, innermost frames:\n" + "".join(traceback.format_stack(frame)[-frames:])


def _format_stacks() -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in current_frames().items():
        parts.append(f'Thread "{names.get(ident, ident)}":\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)
