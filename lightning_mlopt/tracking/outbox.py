"""A durable outbox of what a tracker logs, and the rule that decides which of it survives a relaunch.

A tracker server can be down, and a launch can be killed at any instant; neither may lose a logged value or
send one twice. So a tracker appends each record here first (one JSON line, one ``write``: it survives a
SIGKILL of the process, not of the machine) and a background sender takes the records from here.

Metric rows of training steps are *held* while checkpoints are managed (FaultTolerantCheckpoint tells the
tracker): a killed launch's steps after its last committed checkpoint are redone by the next launch, so only
the surviving computation of each step may reach the server. A row of launch ``L`` at step ``s``:

- survives when the next launch resumed from a checkpoint of step ``R > s``, or, with no later launch yet,
  when ``L`` released it: a committed checkpoint of a step ``> s``, or the launch finished;
- is dropped when the next launch resumed from ``R <= s`` (that launch computes it again);
- waits otherwise.

Steps are compared strictly because Lightning logs a batch's metrics at the number of optimizer steps taken
*before* it: the batch that a checkpoint of step ``R`` ends with logged at step ``R - 1``.

Records that are not held (parameters, tags, system metrics, checkpoint records) can go at once. Sent or
dropped records are marked ``done``; a record sent whose mark a kill cut off is sent again, which the
tracker's server takes as the same value (MLflow ignores an identical metric point).

Example::

    outbox = Outbox(Path("runs/x/mlflow/outbox.jsonl"))
    outbox.resumed(step=10)                       # this launch resumed from step 10
    outbox.add("metrics", step=11, metrics={"train/loss": 2.3})
    outbox.release(step=20)                       # a checkpoint of step 20 committed: rows of steps < 20 go
    for record in outbox.sendable():
        ...                                       # send it
    outbox.mark_done([record["i"] for record in outbox.sendable()])
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_mlopt.checkpoint.manifest import write_atomically

HELD_KINDS = frozenset({"metrics"})
"""Record kinds whose fate waits for a checkpoint (the values of training steps)."""

_ALL = 2**62  # "every step": a launch that finished released all of its rows
_COMPACT_AFTER = 20_000  # done records in the file before a launch rewrites it without them


@dataclass
class _Launch:
    resumed: int | None = None  # the step this launch resumed from (None: checkpoints not managed)
    released: int = 0  # rows below this step survive (while no later launch resumed)
    holds: bool = False  # whether its rows wait for a checkpoint at all


@dataclass
class _State:
    count: int = 0  # records ever written (the next record's index)
    pending: dict[int, dict[str, Any]] = field(default_factory=dict)  # not done, oldest first
    kinds: Counter[str] = field(default_factory=Counter)  # records of each kind, done or not
    keys: dict[str, set[Any]] = field(default_factory=dict)  # the ``key`` fields of each kind's records
    launches: dict[int, _Launch] = field(default_factory=dict)


class Outbox:
    """Records a tracker has to send, on disk, with which of them survive, across every launch of a run.

    Each process that opens the outbox is a new launch (numbered after those already in the file). One
    process writes at a time (rank zero of the run's one job). Only records not yet done are kept in memory;
    a file mostly made of done records is rewritten without them when a launch opens it (atomically).

    Args:
        path: the outbox file (created, with its folder, on first write).

    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._state = _read(path)
        if self._state.count - len(self._state.pending) > _COMPACT_AFTER:
            _compact(path, self._state)
        self.launch = max(self._state.launches, default=0) + 1
        self._state.launches[self.launch] = _Launch()
        self._fd: int | None = None

    # ------------------------------------------------------------------ writing

    def add(self, kind: str, **fields: Any) -> int:
        """Append a record of ``kind`` (``metrics``, ``system``, ``params``, ``tags``, ``json``, ...); its index.

        A ``key`` field is remembered for :meth:`keys` (e.g. the step of a checkpoint record).
        """
        with self._lock:
            record = {"i": self._state.count, "launch": self.launch, "kind": kind, **fields}
            _take(self._state, record)
            self._append(record)
            return int(record["i"])

    def resumed(self, step: int) -> None:
        """Record that this launch resumed from ``step`` (0: a fresh start); its step rows wait for a release."""
        self._control(resumed=step)

    def release(self, step: int | None = None) -> None:
        """Let this launch's rows below ``step`` go (a checkpoint of it committed); None: all (it finished)."""
        self._control(released=_ALL if step is None else step)

    def release_at_once(self) -> None:
        """Checkpoints are not managed for this launch: its rows survive as they are logged."""
        self._control(released=_ALL, holds=False)

    def mark_done(self, indices: Iterable[int]) -> None:
        """Records sent (or dropped): never offered again."""
        indices = sorted(set(indices))
        if not indices:
            return
        with self._lock:
            for index in indices:
                self._state.pending.pop(index, None)
            self._append({"done": indices})

    def _control(self, **fields: Any) -> None:
        with self._lock:
            entry = {"launch": self.launch, **fields}
            _apply_control(self._state, entry)
            self._append(entry)

    def _append(self, entry: dict[str, Any]) -> None:
        # One write per line on an O_APPEND descriptor: a kill cuts at most this line, which reading skips.
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            size = os.fstat(self._fd).st_size
            if size and os.pread(self._fd, 1, size - 1) != b"\n":
                os.write(self._fd, b"\n")  # end the line a kill cut short, so it does not swallow ours
        os.write(self._fd, (json.dumps(entry, default=float, separators=(",", ":")) + "\n").encode())

    def sync(self) -> None:
        """Push what was written to the disk (at rare moments: a checkpoint committed, the end)."""
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)

    def close(self) -> None:
        """Close the file (records stay; a later launch reads them)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    # ------------------------------------------------------------------ reading

    def sendable(self) -> list[dict[str, Any]]:
        """Records not yet done whose fate is decided and that survive, oldest first."""
        with self._lock:
            return [record for record in self._undone() if self._fate(record) is True]

    def dropped(self) -> list[int]:
        """Indices of records not yet done that a later launch recomputed: never to be sent."""
        with self._lock:
            return [record["i"] for record in self._undone() if self._fate(record) is False]

    def waiting(self) -> int:
        """How many records are not done yet (sendable or held)."""
        with self._lock:
            return sum(1 for record in self._undone() if self._fate(record) is not False)

    def count(self, kind: str) -> int:
        """How many records of ``kind`` every launch wrote (e.g. system samples, to number the next)."""
        with self._lock:
            return self._state.kinds[kind]

    def keys(self, kind: str) -> set[Any]:
        """The ``key`` fields of every record of ``kind`` (e.g. the steps whose checkpoints are recorded)."""
        with self._lock:
            return set(self._state.keys.get(kind, ()))

    def _undone(self) -> list[dict[str, Any]]:
        return list(self._state.pending.values())

    def _fate(self, record: dict[str, Any]) -> bool | None:
        """True: survives; False: recomputed by a later launch; None: not decided yet."""
        if record["kind"] not in HELD_KINDS or record.get("step") is None:
            return True
        launches = self._state.launches
        owner = launches.get(record["launch"], _Launch())
        step = int(record["step"])
        later = [number for number in launches if number > record["launch"] and launches[number].resumed is not None]
        if later:
            resumed = launches[min(later)].resumed
            assert resumed is not None
            return step < resumed
        if not owner.holds:
            return True
        return True if step < owner.released else None


def _read(path: Path) -> _State:
    """The state an outbox file describes; records already done are counted, not kept."""
    state = _State()
    if not path.is_file():
        return state
    with path.open() as lines:
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if "done" in entry:
                for index in entry["done"]:
                    state.pending.pop(index, None)
            elif "kind" in entry:
                # Indices are positions: a cut line never got one, so renumber from what was read.
                _take(state, {**entry, "i": state.count})
            elif "summary" in entry:  # what a compaction left of the records it dropped
                state.kinds.update(entry["summary"]["kinds"])
                for kind, keys in entry["summary"]["keys"].items():
                    state.keys.setdefault(kind, set()).update(keys)
            elif "launch" in entry:
                _apply_control(state, entry)
    return state


def _take(state: _State, record: dict[str, Any]) -> None:
    state.launches.setdefault(int(record["launch"]), _Launch())  # a launch killed before any control line
    state.count += 1
    state.pending[int(record["i"])] = record
    state.kinds[record["kind"]] += 1
    if "key" in record:
        state.keys.setdefault(record["kind"], set()).add(record["key"])


def _compact(path: Path, state: _State) -> None:
    """Rewrite the file with what is still needed: the launches, a summary of done records, pending records.

    Renumbers the pending records (indices are positions); written atomically, so a kill leaves the old file or
    the new one.
    """
    pending = list(state.pending.values())
    kinds = Counter(state.kinds)
    kinds.subtract(record["kind"] for record in pending)
    keys = {kind: sorted(values) for kind, values in state.keys.items()}
    lines: list[dict[str, Any]] = [{"summary": {"kinds": dict(kinds), "keys": keys}}]
    for number, launch in sorted(state.launches.items()):
        control: dict[str, Any] = {"launch": number, "released": launch.released, "holds": launch.holds}
        lines.append({**control, **({"resumed": launch.resumed} if launch.resumed is not None else {})})
    state.count, state.pending = 0, {}
    for record in pending:
        renumbered = {**record, "i": state.count}
        state.pending[state.count] = renumbered
        state.count += 1
        lines.append(renumbered)
    write_atomically(path, "".join(json.dumps(line, default=float, separators=(",", ":")) + "\n" for line in lines))


def _apply_control(state: _State, entry: dict[str, Any]) -> None:
    launch = state.launches.setdefault(int(entry["launch"]), _Launch())
    if "resumed" in entry:
        launch.resumed = int(entry["resumed"])
        launch.holds = True
    if "released" in entry:
        launch.released = max(launch.released, int(entry["released"]))
    if "holds" in entry:
        launch.holds = bool(entry["holds"])
