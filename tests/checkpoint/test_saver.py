"""CheckpointSaver without a Trainer: the commit protocol, background writes, failures, retention, stops.

One process with a stand-in Trainer (what the saver reads of one: step, rank, loggers, the state to dump), a
real CheckpointStore in a temporary folder and real files; the multi-process paths run in the callback's tests.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import lightning_mlopt.checkpoint.saver as saver_module
from lightning_mlopt.checkpoint import CheckpointStore, RetentionPolicy, verify
from lightning_mlopt.checkpoint.layout import ONE_FILE
from lightning_mlopt.checkpoint.saver import CheckpointSaver
from lightning_mlopt.checkpoint.serialization import load_file
from lightning_mlopt.checkpoint.store import STATE_NAME
from lightning_mlopt.exceptions import CheckpointWriteError, NonFiniteGradientError


class _Logger:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, metrics))


class _Trainer(SimpleNamespace):
    """What the saver reads of a Trainer, one process: its step, rank, loggers and the state to dump."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(
            global_step=0,
            current_epoch=0,
            global_rank=0,
            world_size=1,
            is_global_zero=True,
            loggers=[_Logger()],
            callback_metrics={},
            strategy=SimpleNamespace(),
        )
        self.weight = weight
        self._checkpoint_connector = SimpleNamespace(dump_checkpoint=self._dump)

    def _dump(self, weights_only: bool = False) -> dict[str, Any]:
        return {"state_dict": {"weight": self.weight}, "global_step": self.global_step}

    @property
    def fit_loop(self) -> SimpleNamespace:
        # As in a batch's end hooks, where saves run: the update is counted in global_step, not yet in the label
        # Lightning gives the batch's logged row.
        return SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=max(self.global_step - 1, 0)))

    __hash__ = object.__hash__


def _saver(root: Path, async_save: bool = False, keep_last: int = 3) -> CheckpointSaver:
    one_file = SimpleNamespace(checkpoint_layout=ONE_FILE, background_saves=False)
    return CheckpointSaver(
        CheckpointStore(root), RetentionPolicy(keep_last, keep_best=0), async_save, strategy=one_file
    )


def _state(path: Path) -> dict[str, Any]:
    return load_file(path / STATE_NAME)


def test_a_save_commits_a_verified_folder_with_its_rng_and_moves_latest(tmp_path):
    trainer, saver = _Trainer(torch.arange(4.0)), _saver(tmp_path)
    trainer.global_step = 5
    saver.save(trainer, reason="every_n_steps")
    committed = saver.store.committed()
    assert [step for step, _ in committed] == [5] and saver.last_saved == committed[0][1]
    manifest = verify(saver.last_saved)  # every file's size and checksum
    assert (manifest.step, manifest.reason, manifest.world_size, manifest.layout) == (5, "every_n_steps", 1, ONE_FILE)
    assert (saver.last_saved / "rng" / "rank-0.pt").is_file()
    assert saver.store.latest_name() == saver.last_saved.name
    assert torch.equal(_state(saver.last_saved)["state_dict"]["weight"], torch.arange(4.0))
    step, row = trainer.loggers[0].rows[-1]
    # In the row Lightning logs step 5's batch in (its label: the 4 updates before it).
    assert step == 4 and row["checkpoint/blocking_s"] > 0 and row["checkpoint/wait_s"] >= 0
    assert saver.take_committed() == [(saver.last_saved, manifest)] and saver.take_committed() == []


def test_a_background_save_writes_the_state_as_it_was_when_the_save_began(tmp_path):
    weight = torch.zeros(256)
    trainer, saver = _Trainer(weight), _saver(tmp_path, async_save=True)
    trainer.global_step = 1
    saver.save(trainer, reason="every_n_steps")  # returns once staged in CPU memory
    weight += 1.0  # training goes on while the write runs
    saver.wait(trainer)
    assert torch.equal(_state(saver.last_saved)["state_dict"]["weight"], torch.zeros(256))
    assert saver.expected_save_seconds() is not None and saver.in_flight_seconds_left() == 0.0


def test_retention_keeps_the_newest_and_never_the_one_just_committed(tmp_path):
    trainer, saver = _Trainer(torch.ones(2)), _saver(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        trainer.global_step = step
        saver.save(trainer, reason="every_n_steps")
    assert [step for step, _ in saver.store.committed()] == [3, 4]


def test_a_failed_background_write_is_raised_at_wait_and_leaves_earlier_checkpoints_intact(tmp_path, monkeypatch):
    trainer, saver = _Trainer(torch.ones(2)), _saver(tmp_path, async_save=True)
    trainer.global_step = 1
    saver.save(trainer, reason="every_n_steps", wait=True)
    first = saver.last_saved
    real_save_file = saver_module.save_file

    def full_disk(obj: Any, path: Path, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == STATE_NAME:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save_file(obj, path, *args, **kwargs)

    monkeypatch.setattr(saver_module, "save_file", full_disk)
    trainer.global_step = 2
    saver.save(trainer, reason="every_n_steps")
    saver._writer.join(None)  # the write ran and failed in the background
    assert saver.failed
    with pytest.raises(CheckpointWriteError, match=r"background checkpoint write failed: .*No space left on device"):
        saver.wait(trainer)
    assert [step for step, _ in saver.store.committed()] == [1] and verify(first).step == 1
    assert not saver.store.staging_path(2).exists()  # the failed write's folder is gone
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([first.name, "latest"])


def test_an_abandoned_write_is_never_committed(tmp_path, monkeypatch):
    from lightning_mlopt.process import exit as process_exit

    monkeypatch.setattr(process_exit, "_ABANDONED", [])  # abandon() registers the thread with the exit path
    trainer, saver = _Trainer(torch.ones(2)), _saver(tmp_path, async_save=True)
    release = threading.Event()
    real_save_file = saver_module.save_file

    def slow(obj: Any, path: Path, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == STATE_NAME:
            release.wait(10)
        return real_save_file(obj, path, *args, **kwargs)

    monkeypatch.setattr(saver_module, "save_file", slow)
    trainer.global_step = 3
    saver.save(trainer, reason="every_n_steps")
    assert saver.in_flight_seconds_left() >= 0.0
    in_flight = saver._writer._thread
    saver.abandon_in_flight()  # a preempted rank with no time left for it
    release.set()
    in_flight.join(10)  # it finished its write, and discarded it
    assert saver.store.committed() == [] and saver.last_saved is None
    assert not saver.store.staging_path(3).exists()


def test_a_save_for_a_stop_says_what_it_did(tmp_path):
    trainer, saver = _Trainer(torch.ones(2)), _saver(tmp_path)
    early = NonFiniteGradientError("stop", checkpoint_first=True)
    saver.save_for_stop(trainer, early, training_started=False)
    assert "nothing was saved: training had not started" in str(early)
    trainer.global_step = 7
    stop = NonFiniteGradientError("stop", checkpoint_first=True)
    saver.save_for_stop(trainer, stop, training_started=True)
    assert f"saved a checkpoint at step 7 (before this update): {saver.last_saved}" in str(stop)
    assert verify(saver.last_saved).reason == "nonfinite"


def test_an_exception_save_is_single_file_only_and_by_rank_zero(tmp_path):
    trainer, saver = _Trainer(torch.ones(2)), _saver(tmp_path)
    trainer.global_step = 4
    saver.strategy = SimpleNamespace(checkpoint_layout="DCP shards", background_saves=False)
    saver.save_after_exception(trainer, RuntimeError("boom"))
    assert saver.store.committed() == []  # a sharded save needs every rank
    saver.strategy = SimpleNamespace(checkpoint_layout=ONE_FILE, background_saves=False)
    saver.save_after_exception(trainer, RuntimeError("boom"))
    assert verify(saver.store.committed()[0][1]).reason == "exception"
