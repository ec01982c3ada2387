"""One live job per run directory: the lock that rank zero of a ``fit`` holds, and the record that names it.

Two jobs in one run directory (a job submitted twice, a requeue while the old allocation still runs) would
share its checkpoints folder (retention, ``latest``), ``metrics.json`` and the logger's versions. So rank zero
holds ``<run_dir>/run.lock`` before the run writes anything, and a second launch is refused in one line that
names the holder (host, pid, job id, since when) and what to do.

How a holder is told alive from dead:

- ``fcntl.flock`` on the file. The kernel drops it when the process ends, however it ends (SIGKILL included),
  so a dead job's lock is free at once on a local filesystem. The descriptor is closed in forked children (a
  DataLoader worker would otherwise keep a killed job's lock) and not inherited across ``exec``.
- The record in the file (host, pid, job id, start in UTC) names the holder in the refusal, and the file's
  modification time is a heartbeat that a daemon thread refreshes every ``heartbeat_s``. It decides what flock
  cannot see: shared filesystems differ (NFSv4 and GPFS lock across hosts; Lustre only when mounted with
  ``flock``, per node with ``localflock``, not at all otherwise). A holder on this host is alive while it
  holds the flock (where flock fails: while its pid lives). A holder on another host is alive while its
  heartbeat moves; it is dead once the heartbeat is ``stale_after_s`` old by this host's clock, or has not
  moved for ``stale_after_s`` while this launch watched (so clock skew cannot stretch the wait). A dead job on
  another host costs the next launch at most ``stale_after_s``; a live one is never taken over while its
  heartbeat runs (a filesystem that stalls the heartbeat longer than ``stale_after_s`` without flock could
  let a second holder in: that is the price of not trusting flock across hosts).
- The file is never deleted or replaced (a second launch could lock a new file while the first still holds
  the old one); a holder that ends cleanly empties it.

A launch of the same job (the same ``SLURM_JOB_ID`` or ``TORCHELASTIC_RUN_ID``: a requeue that came while its
earlier attempt is still ending) waits for the holder, ``wait_s`` at most; any other live holder is refused
at once. Standard library only.

Example::

    lock = RunLock(Path("runs/gpt-1a2b3c4d"))
    lock.acquire(wait_s=150)   # RunDirBusy (exit 2): "... in use by host a1, pid 4242, job 77, since ..."
    ...
    release_held()             # also when this rank writes its exit status, and at interpreter exit
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from lightning_mlopt.exceptions import RunDirBusy
from lightning_mlopt.process import launch_report
from lightning_mlopt.run_dir import RUN_LOCK_NAME

HEARTBEAT_S = 10.0
"""How often the holder refreshes the lock file's modification time."""
STALE_AFTER_S = 60.0
"""A holder on another host whose heartbeat is this old, or stood still this long, is a dead job's."""
DEFAULT_WAIT_S = 150.0
"""How long a launch of the same job waits: past the signal deadline (120 s) a preempted job ends by."""
JOB_ID_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
"""Where a job's identity is read, first found wins; torchrun's default run id ``none`` is no identity."""
_NO_RECORD_GRACE_S = 2.0  # a holder writes its record within microseconds of its flock; an empty one is brief

FREE, ALIVE, UNSURE = "free", "alive", "unsure"


@dataclass(frozen=True)
class _Holder:
    """What the lock file says about the process holding it."""

    host: str
    pid: int
    job: str | None
    since: str  # UTC, ISO 8601 to the second
    token: str  # tells this holder from an earlier one with the same host and pid

    def describe(self) -> str:
        job = f", job {self.job}" if self.job else ""
        return f"host {self.host}, pid {self.pid}{job}, since {self.since.replace('T', ' ')} UTC"


def job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The identity of this job across its requeues: ``SLURM_JOB_ID`` or ``TORCHELASTIC_RUN_ID``, else None.

    Example::

        >>> job_id({"SLURM_JOB_ID": "77"}), job_id({"TORCHELASTIC_RUN_ID": "none"})
        ('77', None)
    """
    for name in JOB_ID_VARIABLES:
        value = environ.get(name)
        if value and value != "none":
            return value
    return None


def judge(
    locked: bool | None,
    holder: _Holder | None,
    age_s: float,
    still_for_s: float,
    moved: bool,
    stale_after_s: float = STALE_AFTER_S,
    pid_alive: Callable[[int], bool] | None = None,
) -> str:
    """Whether the recorded holder is alive: :data:`FREE`, :data:`ALIVE`, or :data:`UNSURE` (look again).

    Args:
        locked: whether this launch got the flock (None: this filesystem has no flock).
        holder: the record in the file (None: empty, or unreadable).
        age_s: the heartbeat's age by this host's clock.
        still_for_s: how long this launch has watched the heartbeat stand still.
        moved: whether the heartbeat moved while this launch watched.
        stale_after_s: see :data:`STALE_AFTER_S`.
        pid_alive: whether a process id lives on this host (default: a signal 0 reaches it).

    Example::

        >>> judge(False, None, 0.0, 0.0, False)   # someone holds the flock
        'alive'

    """
    if locked is False:
        return ALIVE  # a live process holds the flock: on this host, or across hosts where flock reaches
    if holder is None:
        return FREE
    if holder.host == socket.gethostname():
        if locked:
            return FREE  # its flock would still be held: the process is gone
        return ALIVE if (pid_alive or _pid_alive)(holder.pid) and age_s < stale_after_s else FREE
    if age_s >= stale_after_s or still_for_s >= stale_after_s:
        return FREE
    return ALIVE if moved else UNSURE


class RunLock:
    """Holds a run directory for this process: the flock, the record and its heartbeat.

    Args:
        run_dir: the run directory (made if missing).
        heartbeat_s: see :data:`HEARTBEAT_S`.
        stale_after_s: see :data:`STALE_AFTER_S`.
        poll_s: how often a launch that waits looks again.

    Raises:
        ValueError: a non-positive interval.

    Example::

        lock = RunLock(Path("runs/a"))
        lock.acquire()            # or RunDirBusy naming the live holder
        lock.release()

    """

    def __init__(
        self,
        run_dir: Path,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        poll_s: float = 0.5,
    ) -> None:
        if min(heartbeat_s, stale_after_s, poll_s) <= 0:
            raise ValueError(f"intervals must be > 0, got {heartbeat_s=}, {stale_after_s=}, {poll_s=}")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RUN_LOCK_NAME
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.poll_s = poll_s
        self.took_over: _Holder | None = None  # the dead job whose record this lock replaced
        self._fd: int | None = None
        self._holder: _Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """Whether this process holds the run directory through this lock."""
        return self._fd is not None

    def acquire(self, wait_s: float = 0.0) -> None:
        """Hold the run directory, or raise :class:`RunDirBusy` naming its live holder.

        ``wait_s``: how long to wait for a holder of the same job (see :func:`job_id`); others are refused at once.
        A directory where the file cannot be made (a read-only mount) is not held: the run's own checks of its
        folders say what is wrong, with their own status.
        """
        if self._fd is not None:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # never truncated: the holder's record stays
        except OSError:
            return
        try:
            self.took_over = self._wait_until_free(fd, wait_s)
            self._holder = _Holder(
                socket.gethostname(),
                os.getpid(),
                job_id(),
                datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", ""),
                uuid.uuid4().hex,
            )
            _write_record(fd, self._holder)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _hold(self)
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat, empty the record if it is still this holder's, and drop the flock."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            record, _ = _read_record(fd)
            if record is not None and self._holder is not None and record.token == self._holder.token:
                os.ftruncate(fd, 0)  # before the flock goes: a successor never finds our record on its lock
        os.close(fd)
        _HELD.discard(self)

    def _wait_until_free(self, fd: int, wait_s: float) -> _Holder | None:
        """Take the flock (where there is one) once no live job holds the directory; return the dead holder, if any."""
        mine, started = job_id(), time.monotonic()
        seen: tuple[str, float, float] | None = None  # (holder token, heartbeat, when first seen)
        said = False
        while True:
            locked = _try_flock(fd)
            holder, heartbeat = _read_record(fd)
            now = time.monotonic()
            key = holder.token if holder is not None else ""
            if seen is None or seen[0] != key:
                seen = (key, heartbeat, now)
            moved = heartbeat != seen[1]
            verdict = judge(
                locked,
                holder,
                age_s=time.time() - heartbeat,
                still_for_s=0.0 if moved else now - seen[2],
                moved=moved,
                stale_after_s=self.stale_after_s,
            )
            if locked is False and holder is None and now - started < _NO_RECORD_GRACE_S:
                verdict = UNSURE  # taken a moment ago, its record not yet written (or a holder emptying it, leaving)
            if verdict == FREE:
                return holder  # with the flock taken (where this filesystem has one)
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)  # not ours to keep while its holder may live
            waited = now - started
            same_job = holder is not None and mine is not None and holder.job == mine
            if verdict == ALIVE and not (same_job and waited < wait_s):
                raise RunDirBusy(self._refusal(holder, waited if same_job else None))
            if verdict == ALIVE and not said and holder is not None:
                said = True
                print(
                    f"run_dir: {self.run_dir} is held by an earlier attempt of this job ({holder.describe()}); "
                    f"waiting up to {wait_s:.0f} s for it to end (run_dir_wait)",
                    flush=True,
                )
            time.sleep(self.poll_s)

    def _refusal(self, holder: _Holder | None, waited: float | None) -> str:
        who = holder.describe() if holder is not None else "a process that has not said who it is"
        after = f" (waited {waited:.0f} s for it, an earlier attempt of this job: run_dir_wait)" if waited else ""
        return (
            f"run_dir: {self.run_dir} is in use by a live job ({who}){after}; a run directory holds one job at a "
            "time: wait for that job to end, stop it, or launch this one with another --run_dir"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            fd = self._fd
            if fd is None:
                return
            with contextlib.suppress(OSError):  # a missed beat is one beat: the next may land
                os.utime(fd)


def release_held() -> None:
    """Release every run lock this process holds (as the rank writes its exit status, and at interpreter exit).

    Example::

        release_held()
    """
    for lock in list(_HELD):
        lock.release()


_HELD: set[RunLock] = set()
_hooks_installed = False


def _hold(lock: RunLock) -> None:
    global _hooks_installed
    _HELD.add(lock)
    if not _hooks_installed:
        _hooks_installed = True
        # The run is over once this rank writes its exit status (main's end, an agreed exit, a preempted start-up);
        # the interpreter's exit covers the rest. os._exit and kills leave the record for the flock's death to void.
        launch_report.on_exit(lambda status: release_held())
        atexit.register(release_held)
        os.register_at_fork(after_in_child=_forget_in_child)


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) must not hold its parent's lock alive: close its copy, hold nothing."""
    for lock in list(_HELD):
        fd, lock._fd, lock._thread = lock._fd, None, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()


def _try_flock(fd: int) -> bool | None:
    """Take the flock without waiting: True, False (held elsewhere), None (this filesystem has none)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise
    return True


def _read_record(fd: int) -> tuple[_Holder | None, float]:
    """The record (None if empty or unreadable) and the heartbeat (the file's modification time)."""
    data, heartbeat = os.pread(fd, 4096, 0), os.fstat(fd).st_mtime
    try:
        # raw_decode: a rewrite lands over the old record before the file is cut to length; ignore what trails.
        fields, _ = json.JSONDecoder().raw_decode(data.decode())
        return _Holder(**fields), heartbeat
    except (ValueError, TypeError):
        return None, heartbeat


def _write_record(fd: int, holder: _Holder) -> None:
    # Written over the old record, then cut to length: the file is never empty while a holder has it.
    data = json.dumps(asdict(holder)).encode() + b"\n"
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True
