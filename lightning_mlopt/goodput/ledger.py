"""GoodputLedger: every launch of a run appends where its wall-clock time went to ``<run_dir>/goodput.jsonl``.

One short JSON line per event, written by rank zero as a copy into a shared mapping of the file
(``goodput/append_log.py``): a line is in the page cache the moment the copy ends, so a SIGKILL a
microsecond later loses nothing written before it, and a step costs no system call. ``fsync`` runs only at
rare events (the launch's start, each checkpoint commit, the end, the exit), never per step. No collective and
no host-device synchronisation: the host clock (``time.time``) on rank zero times everything, from the phase
changes the step already marks (``process/phase.py``).

The events (``goodput/report.py`` reads them; ``python -m lightning_mlopt goodput RUN_DIR`` prints
the report)::

    {"event": "launch", "time": T, "process_start": T0, "pid": 123, "world_size": 2}
    {"event": "train_start", "time": T, "step": 40, "restore_s": 0.8, "resumed_from": ".../step-000000040"}
    {"event": "step", "time": T, "step": 41, "seconds": 0.153, "data_s": 0.002, "checkpoint_s": 0.0, "other_s": 0.0}
    {"event": "commit", "time": T, "step": 45}
    {"event": "signal", "time": T, "signal": "SIGTERM"}
    {"event": "end", "time": T, "step": 48, "ok": false, "checkpoint_s": 0.4, "error": "SystemExit"}
    {"event": "exit", "time": T, "status": 75}

A step's record covers the time from the start of its batch's fetch to the start of the next batch's fetch, so
the records of one launch tile its training time: the step itself, the checkpoint save that followed it (its
blocking part), and validation run after it (``other_s``). A launch killed with SIGKILL has no ``end`` or
``exit``: its last event ends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_mlopt._metrics import log_metrics
from lightning_mlopt.callbacks.phase_markers import PhaseMarkers
from lightning_mlopt.checkpoint.manifest import Manifest
from lightning_mlopt.goodput.append_log import AppendLog, append_line
from lightning_mlopt.hooks import checkpoint_events
from lightning_mlopt.process import launch_report, phase
from lightning_mlopt.process.signals import preemption
from lightning_mlopt.run_dir import GOODPUT_LEDGER_NAME

# A step's own phases: what is left of its record's duration after data wait, checkpoint and "other" (any
# other phase: validation, PerformanceMonitor's own work, setup).
_STEP_PHASES = frozenset({"forward", "backward", "optimizer", "loop"})
_OTHER = "other_s"


class GoodputLedger(PhaseMarkers):
    """Appends each launch's start, steps, checkpoint commits, restore, signals and exit to a ledger file.

    Rank zero writes; the other ranks only mark phases. The ledger is what ``python -m lightning_mlopt goodput``
    turns into the run's goodput (the share of wall-clock time spent on steps whose results survived) and its
    badput by category, over every launch. At the end of each launch (``on_fit_end``, or after an exception,
    a preemption's exit included) the figures of all launches so far are logged as ``goodput/*`` through the
    trainer's loggers.

    Cost per step: one call where the next batch's fetch begins (the phases' times are read from the totals the
    phase markers keep) and a copy of about 130 bytes into a mapped file; no system call, no fsync. Measured:
    0.094% of the GPT demo's step time on 2 CPU processes (``benchmarks/results/goodput_cpu-2proc_202611.md``).
    A ledger that cannot be written (a full disk) warns once and stops recording; training goes on.

    Args:
        path: the ledger file; None: ``<trainer.default_root_dir>/goodput.jsonl`` (the CLI's run directory).
        log_goodput: log ``goodput/*`` metrics through the trainer's loggers at the end of each launch.

    Raises:
        ValueError: ``path`` is empty or an existing folder.

    Example::

        trainer = Trainer(default_root_dir="runs/a", callbacks=[FaultTolerantCheckpoint(), GoodputLedger()])
        trainer.fit(model)  # appends to runs/a/goodput.jsonl; then: python -m lightning_mlopt goodput runs/a

    """

    def __init__(self, path: str | None = None, log_goodput: bool = True) -> None:
        if path is not None and (not str(path).strip() or Path(path).is_dir()):
            raise ValueError(f"path: {path!r} is empty or a folder; name the ledger file, e.g. runs/a/goodput.jsonl")
        self.path = path
        self.log_goodput = log_goodput
        self.file: Path | None = None  # where this launch writes (rank zero, from setup)
        self._log: AppendLog | None = None  # rank zero, from setup to the end of fit
        self._since = 0.0  # when the open record began (time.time())
        self._totals: dict[str, float] = {}  # the process's seconds per phase when it began (phase.totals())
        self._step = 0
        self._step_done = False  # a batch ended since the open record began: the next fetch closes it
        self._signalled = False
        self._ended = False

    # ------------------------------------------------------------------ lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        self.file = Path(self.path) if self.path else Path(trainer.default_root_dir) / GOODPUT_LEDGER_NAME
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            self._log = AppendLog(self.file)
        except OSError as error:
            rank_zero_warn(f"goodput: cannot write {self.file} ({error}); this launch is not recorded")
            return
        now, self._totals = time.time(), phase.totals()
        self._since = now
        self._ended = self._signalled = self._step_done = False
        record = {"process_start": round(process_start_time(), 4), "pid": os.getpid()}
        self._write("launch", now, {**record, "world_size": trainer.world_size}, sync=True)
        # Told only where a fetch begins (a call per step, not one per phase change): the phases' times are
        # read from the process's totals there.
        phase.add_listener(self, entering=("data",))
        _Exit.expect(self.file)
        launch_report.on_exit(_Exit.record)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._log is None:
            return
        store = checkpoint_events(trainer).store  # the checkpointing callback set up before this hook
        if store is not None:
            store.add_commit_listener(self._on_commit)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._log is None:
            return
        now, spent = self._account()
        resumed = checkpoint_events(trainer).resumed_from
        fields = {"step": trainer.global_step, "restore_s": round(spent.get("restore", 0.0), 5)}
        self._write("train_start", now, {**fields, "resumed_from": str(resumed) if resumed else None}, sync=True)
        self._since = now

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        if self._log is None:
            return
        self._step, self._step_done = trainer.global_step, True
        if not self._signalled and preemption.received() is not None:  # one attribute read per step
            self._signalled = True
            self._write("signal", time.time(), {"signal": preemption.describe()})

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._log is not None and self._step_done:  # the last step: no next fetch will close it
            self._close_step(*self._account())

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end(trainer, ok=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A preemption's SystemExit(75) comes here too, right after the signal save of the step that just ended.
        if self._log is not None and self._step_done:
            self._close_step(*self._account())
        self._end(trainer, ok=False, error=type(exception).__name__)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._end(trainer, ok=trainer.state.status.value != "interrupted")

    # ------------------------------------------------------------------ phases

    def switch(self, ended: str) -> None:
        """A fetch begins (``process/phase.py`` tells only that): after a finished batch it closes its record."""
        if self._step_done:
            self._close_step(*self._account())

    def _account(self) -> tuple[float, dict[str, float]]:
        """Now, and the seconds per phase since the open record began; the next record begins now."""
        now, totals = time.time(), phase.totals()
        before = self._totals
        spent = {name: seconds - before.get(name, 0.0) for name, seconds in totals.items()}
        self._totals = totals
        return now, spent

    def _close_step(self, now: float, spent: dict[str, float]) -> None:
        data, saving = spent.get("data", 0.0), spent.get("checkpoint", 0.0)
        other = sum(seconds for name, seconds in spent.items() if name not in _STEP_PHASES) - data - saving
        # Formatted by hand: the one record written every step (json.dumps costs several times more).
        line = (
            f'{{"event":"step","time":{now:.6f},"step":{self._step},"seconds":{now - self._since:.6f},'
            f'"data_s":{data:.6f},"checkpoint_s":{saving:.6f},"{_OTHER}":{other:.6f}}}\n'
        )
        self._store(line)
        self._since, self._step_done = now, False

    def _end(self, trainer: pl.Trainer, ok: bool, error: str | None = None) -> None:
        """Write the launch's ``end`` (once), log the goodput of every launch so far, and close the file."""
        if self._log is None or self._ended:
            return
        self._ended = True
        phase.remove_listener(self)
        now, spent = self._account()
        fields: dict[str, Any] = {"step": trainer.global_step, "ok": ok}
        fields["checkpoint_s"] = round(spent.get("checkpoint", 0.0), 6)
        if error is not None:
            fields["error"] = error
        self._write("end", now, fields, sync=True)
        log, self._log = self._log, None
        with contextlib.suppress(OSError):
            log.close()
        if self.log_goodput and self.file is not None:
            from lightning_mlopt.goodput.report import compute, read_ledger

            with contextlib.suppress(Exception):  # a figure for the loggers must never end the run
                log_metrics(trainer, compute(read_ledger(self.file)).metrics())

    # ------------------------------------------------------------------ writing

    def _on_commit(self, manifest: Manifest, folder: Path) -> None:
        """A checkpoint was committed (on the thread that committed it): its step survives a kill from now on."""
        with contextlib.suppress(OSError):  # never fail a commit for the ledger's sake
            self._write("commit", time.time(), {"step": manifest.step, "final": manifest.final}, sync=True)

    def _write(self, event: str, now: float, fields: dict[str, Any], sync: bool = False) -> None:
        self._store(json.dumps({"event": event, "time": round(now, 6), **fields}, separators=(",", ":")) + "\n", sync)

    def _store(self, line: str, sync: bool = False) -> None:
        log = self._log
        try:
            if log is not None:
                log.write(line.encode(), sync)
            elif self.file is not None:  # a background commit after the launch's end: one line, opened for it
                append_line(self.file, line)
        except OSError as error:  # a full disk: stop recording, never stop training
            if log is not None and self._log is log:
                self._log = None
                with contextlib.suppress(OSError):
                    log.close()  # what it holds stays, without the reserved padding; the descriptor is freed
                rank_zero_warn(f"goodput: cannot write {self.file} ({error}); the rest of this launch is not recorded")


class _Exit:
    """The exit status goes to the ledger of the newest launch in this process.

    The CLI's exit comes after the Trainer's teardown, so the ledger's own file handle is closed by then.
    """

    path: Path | None = None

    @classmethod
    def expect(cls, path: Path) -> None:
        cls.path = path

    @classmethod
    def record(cls, status: int) -> None:
        path, cls.path = cls.path, None  # one exit per launch
        if path is not None:
            line = {"event": "exit", "time": round(time.time(), 6), "status": status}
            with contextlib.suppress(OSError):
                append_line(path, json.dumps(line, separators=(",", ":")) + "\n")


def process_start_time() -> float:
    """UNIX time this process started, so start-up includes the interpreter and the imports.

    From ``/proc/self/stat`` (start time in clock ticks since boot) against ``CLOCK_BOOTTIME``: 10 ms
    resolution (psutil's ``create_time`` adds the boot time, which ``/proc/stat`` gives in whole seconds).
    Elsewhere psutil; without it, now.

    Example::

        >>> 0 <= time.time() - process_start_time() < 3600
        True
    """
    try:
        after_name = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        ticks = int(after_name[19])  # field 22, starttime; the fields after the name start at field 3
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return time.time()
