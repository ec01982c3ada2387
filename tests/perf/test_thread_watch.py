"""ThreadWatch: the thread verdicts from the numbers, once per run, and PerformanceMonitor's warnings in a fit."""

from __future__ import annotations

import os
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_mlopt._compat import set_num_threads_for_processes
from lightning_mlopt.callbacks import PerformanceMonitor
from lightning_mlopt.callbacks import performance_monitor as monitor_module
from lightning_mlopt.perf.breakdown import JobWindow, RankWindow
from lightning_mlopt.perf.thread_watch import (
    MIN_PREDICTED_STEP_S,
    SLOW_STEP_FACTOR,
    ThreadWatch,
    available_cores,
    local_processes,
    oversubscription_message,
    slow_step_message,
    suggested_threads,
)


@pytest.fixture(autouse=True)
def _restore_threads():
    """Every test leaves torch's thread count and OMP_NUM_THREADS as it found them (the launcher sets both)."""
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    yield
    torch.set_num_threads(threads)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


# ---------------------------------------------------------------------------- the numbers


@pytest.mark.parametrize(
    ("threads", "processes", "cores", "fix"),
    [
        (8, 1, 2, 2),  # a user's torch.set_num_threads(8) on 2 cores
        (2, 2, 2, 1),  # two ranks each on torch's default (all cores): FSDP's rank 1 before issue 27
        (3, 2, 4, 2),
        (8, 4, 16, 4),
    ],
)
def test_more_threads_than_cores_is_named_with_the_numbers_and_the_fix(threads, processes, cores, fix):
    message = oversubscription_message(threads, processes, cores)
    assert message is not None
    assert f"{threads} intra-op threads x {processes} local process" in message
    assert f"= {threads * processes} > {cores} cores" in message
    assert f"OMP_NUM_THREADS={fix} (or torch.set_num_threads({fix})): cores // local processes" in message
    assert "\n" not in message  # one line


@pytest.mark.parametrize(
    ("threads", "processes", "cores"),
    [
        (2, 1, 2),  # torch's default, one process
        (1, 2, 2),  # what Lightning's launcher sets for 2 ranks on 2 cores; torchrun's OMP_NUM_THREADS=1
        (4, 2, 8),
        (1, 4, 2),  # more processes than cores: one thread each cannot be lowered; no thread setting to fix
        (1, 1, 1),
    ],
)
def test_threads_that_fit_the_cores_are_not_reported(threads, processes, cores):
    assert oversubscription_message(threads, processes, cores) is None


def test_an_omp_num_threads_override_is_named_as_the_cause():
    message = oversubscription_message(8, 2, 2, omp_num_threads="8")
    assert message is not None and "OMP_NUM_THREADS=8 is set" in message and "OMP_NUM_THREADS=1 (" in message
    assert "raised by torch.set_num_threads(), or torch's default" in (oversubscription_message(8, 2, 2) or "")


@pytest.mark.parametrize("cores", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("processes", [1, 2, 3, 4, 8])
def test_the_count_our_strategies_set_is_never_reported_and_a_later_override_is(monkeypatch, cores, processes):
    """``set_num_threads_for_processes`` (our FSDP; Lightning's launchers call the same function) passes the check."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the launcher sets it only where it is not set
    set_num_threads_for_processes(processes)
    assert available_cores() == cores
    assert torch.get_num_threads() == suggested_threads(processes, cores)
    assert oversubscription_message(torch.get_num_threads(), processes, cores, os.environ["OMP_NUM_THREADS"]) is None
    torch.set_num_threads(suggested_threads(processes, cores) + 1)  # a user's module raising it afterwards
    override = oversubscription_message(torch.get_num_threads(), processes, cores)
    assert (override is not None) == ((suggested_threads(processes, cores) + 1) * processes > cores)


def test_a_step_far_slower_than_the_probe_predicts_is_named_with_the_threads():
    message = slow_step_message(step_s=0.3, predicted_s=0.01, threads=2, processes=1, cores=2)
    assert message is not None
    assert "steps take 300 ms, 30x the 10.0 ms the matmul probe predicts" in message
    assert "with 2 intra-op threads x 1 local process on 2 cores" in message
    assert "try OMP_NUM_THREADS=1" in message  # threads fit the cores: other load on them is the suspect
    oversubscribed = slow_step_message(step_s=0.3, predicted_s=0.01, threads=8, processes=2, cores=2)
    assert oversubscribed is not None and "set OMP_NUM_THREADS=1 (or torch.set_num_threads(1))" in oversubscribed


@pytest.mark.parametrize(
    ("step_s", "predicted_s", "threads"),
    [
        (0.9 * SLOW_STEP_FACTOR * 0.01, 0.01, 2),  # within the factor
        (100 * MIN_PREDICTED_STEP_S / 2, MIN_PREDICTED_STEP_S / 2, 2),  # tiny model: the loop's cost dominates
        (0.3, 0.01, 1),  # one thread: threads are not the cause
    ],
)
def test_steps_near_the_prediction_tiny_models_and_one_thread_are_not_reported(step_s, predicted_s, threads):
    assert slow_step_message(step_s, predicted_s, threads, processes=1, cores=2) is None


def _said(recwarn) -> list[str]:
    return [str(w.message) for w in recwarn if str(w.message).startswith("PerformanceMonitor:")]


def test_the_watch_warns_once_per_run_and_only_on_cpu(recwarn, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    torch.set_num_threads(4)
    # 10 batches of 300 ms against 10 ms predicted (1e9 FLOPs per batch at 1e11 FLOP/s): 30x.
    job = JobWindow([RankWindow(seconds=3.0, batches=10, flops=1e10, measured_peak_flops=1e11)])
    watch = ThreadWatch()
    watch.start(torch.device("meta"), num_devices=2)  # not a CPU: nothing judged
    watch.judge(job)
    assert _said(recwarn) == []
    watch.start(torch.device("cpu"), num_devices=2)
    watch.start(torch.device("cpu"), num_devices=2)  # a second fit of the same run: said once
    watch.judge(JobWindow([RankWindow(seconds=2.7, batches=9, flops=9e9, measured_peak_flops=1e11)]))  # too few
    watch.judge(job)
    watch.judge(job)
    said = _said(recwarn)
    assert len(said) == 2, said
    assert "4 intra-op threads x 2 local processes = 8 > 2 cores" in said[0]
    assert "steps take 300 ms, 30x the 10.0 ms" in said[1] and "set OMP_NUM_THREADS=1" in said[1]


def test_no_flop_count_or_no_probe_predicts_nothing(recwarn):
    torch.set_num_threads(2)
    watch = ThreadWatch()
    watch.start(torch.device("cpu"), num_devices=1)
    watch.judge(JobWindow([RankWindow(seconds=3.0, batches=10, flops=1e10)]))  # measure_peak=False
    assert not [message for message in _said(recwarn) if "probe" in message]


def test_local_processes_are_the_devices_per_node_or_torchruns_count(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_processes(2) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_processes(1) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert local_processes(3) == 3


# ---------------------------------------------------------------------------- a real fit


class _TinyRegression(pl.LightningModule):
    """A linear model; ``threads`` is set in ``setup`` (after any launcher), ``nap_s`` slept in every step."""

    def __init__(self, threads: int | None = None, nap_s: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.threads, self.nap_s = threads, nap_s

    def setup(self, stage: str) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        time.sleep(self.nap_s)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(128, 8), torch.randn(128, 1)), batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path, model: pl.LightningModule, monitor: PerformanceMonitor, steps: int) -> list[str]:
    """Fit on one CPU process; the warnings PerformanceMonitor gave."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[monitor],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return [str(w.message) for w in caught if str(w.message).startswith("PerformanceMonitor:")]


@pytest.mark.slow
def test_a_fit_with_threads_raised_above_the_cores_warns_once_with_the_numbers(tmp_path):
    cores = available_cores()
    said = _fit(tmp_path, _TinyRegression(threads=4 * cores), PerformanceMonitor(measure_peak=False), steps=3)
    oversubscribed = [message for message in said if "oversubscribed" in message]
    assert len(oversubscribed) == 1, said
    assert f"{4 * cores} intra-op threads x 1 local process = {4 * cores} > {cores} cores" in oversubscribed[0]
    assert f"OMP_NUM_THREADS={cores} (or torch.set_num_threads({cores}))" in oversubscribed[0]


@pytest.mark.slow
def test_a_fit_with_one_thread_per_core_says_nothing_of_threads(tmp_path):
    said = _fit(tmp_path, _TinyRegression(threads=available_cores()), PerformanceMonitor(measure_peak=False), steps=3)
    assert not [message for message in said if "threads" in message], said


@pytest.mark.slow
def test_a_fit_far_slower_than_the_probe_predicts_warns_once_with_the_threads(tmp_path, monkeypatch):
    # A fixed probe (100 GFLOP/s) and 5e8 FLOPs per batch: 5 ms predicted; every step naps 80 ms (16x).
    monkeypatch.setattr(monitor_module, "measure_peak_flops", lambda device, precision: 1e11)
    monitor = PerformanceMonitor(log_every_n_steps=1, flops_per_sample=5e8 / 4)
    said = _fit(tmp_path, _TinyRegression(threads=2, nap_s=0.08), monitor, steps=14)
    slow = [message for message in said if "the matmul probe predicts" in message]
    assert len(slow) == 1, said
    assert "x the 5.0 ms the matmul probe predicts" in slow[0]
    assert f"with 2 intra-op threads x 1 local process on {available_cores()} cores" in slow[0]
