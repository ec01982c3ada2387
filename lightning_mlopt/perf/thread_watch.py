"""ThreadWatch: CPU thread oversubscription (more intra-op threads on a node than cores) and its symptom.

Each of torch's intra-op threads wants a core. When ``threads x processes on this node`` exceeds the cores
this process may run on, every parallel operator waits at its barrier for threads the OS has parked, and
steps get many times slower (``docs/performance.md`` has a measurement). Lightning's launchers (and our FSDP
strategy, through ``set_num_threads_for_processes`` in ``_compat.py``) set ``cores // processes`` unless
``OMP_NUM_THREADS`` is set; a user's ``torch.set_num_threads(8)`` or ``OMP_NUM_THREADS=8`` overrides that.
The pure functions here take the numbers and return the warning to give, or None; :class:`ThreadWatch`
reads the numbers and says each warning once for PerformanceMonitor on CPU runs.

Example::

    >>> oversubscription_message(threads=8, processes=2, cores=2) is not None
    True
    >>> oversubscription_message(threads=1, processes=2, cores=2) is None
    True
"""

from __future__ import annotations

import os
import statistics

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mlopt.perf.breakdown import JobWindow

SLOW_STEP_FACTOR = 10.0
"""How many times slower than the matmul probe's prediction a step must be to be called far off. Healthy CPU
runs measured 1.2x (GPT demo) to 3.6x (the quickstart ResNet: small convolutions) on 2 cores, so 5x would
sit too close; 8 threads on those 2 cores made the ResNet 29x."""

MIN_PREDICTED_STEP_S = 2e-3
"""Below this predicted compute per step, the loop's fixed cost (Lightning, the optimizer, callbacks: about
1-3 ms on a CPU) dominates the step, so a tiny model is always "far off" its prediction: it is not judged."""

SLOW_STEP_BATCHES = 10
"""Fewest batches the step-time verdict is drawn from (fewer are too noisy)."""


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity mask where the OS has one, else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def local_processes(num_devices: int) -> int:
    """Processes of this job on this node: the trainer's devices per node, or torchrun's ``LOCAL_WORLD_SIZE``."""
    try:
        launched = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        launched = 1
    return max(1, num_devices, launched)


def suggested_threads(processes: int, cores: int) -> int:
    """The intra-op threads each of ``processes`` local processes should run: ``cores // processes``, at least 1.

    The figure Lightning's launchers set (``_suggested_max_num_threads``).
    """
    return max(1, cores // max(1, processes))


def oversubscription_message(
    threads: int, processes: int, cores: int, omp_num_threads: str | None = None
) -> str | None:
    """The warning for ``threads`` intra-op threads in each of ``processes`` local processes on ``cores``; or None.

    None when ``threads x processes <= cores``, and when ``threads`` is 1: one thread cannot be lowered, and more
    processes than cores is a choice (a cluster config debugged on a laptop), not a thread setting to fix.

    Args:
        threads: ``torch.get_num_threads()`` in this process.
        processes: processes of this job on this node (``trainer.num_devices`` on CPU).
        cores: cores this process may run on (:func:`available_cores`).
        omp_num_threads: the ``OMP_NUM_THREADS`` environment variable, named as the cause when it is set.

    Example::

        >>> print(oversubscription_message(8, 1, 2))  # doctest: +ELLIPSIS
        PerformanceMonitor: CPU threads oversubscribed: 8 intra-op threads x 1 local process = 8 > 2 cores ...

    """
    if threads <= 1 or threads * processes <= cores:
        return None
    fix = suggested_threads(processes, cores)
    source = (
        f"OMP_NUM_THREADS={omp_num_threads} is set"
        if omp_num_threads is not None
        else "raised by torch.set_num_threads(), or torch's default"
    )
    plural = "es" if processes != 1 else ""
    return (
        f"PerformanceMonitor: CPU threads oversubscribed: {threads} intra-op threads x {processes} local "
        f"process{plural} = {threads * processes} > {cores} cores available to this process ({source}); each "
        f"parallel operator waits for threads the OS cannot run, which can make steps several to 40x slower. Set "
        f"OMP_NUM_THREADS={fix} (or torch.set_num_threads({fix})): cores // local processes"
    )


def slow_step_message(
    step_s: float,
    predicted_s: float,
    threads: int,
    processes: int,
    cores: int,
    factor: float = SLOW_STEP_FACTOR,
) -> str | None:
    """The warning for a CPU step far slower than the matmul probe predicts for its FLOPs; or None.

    ``predicted_s`` is the step's counted FLOPs at the FLOP/s of PerformanceMonitor's matmul probe (run on
    every rank at once, with the run's threads), so ``predicted_s / step_s`` is about ``perf/mfu_measured``. None
    when the step is within ``factor`` of it, when the prediction is under :data:`MIN_PREDICTED_STEP_S` (the
    loop's fixed cost dominates), and when ``threads`` is 1 (then threads are not the cause to name).

    Args:
        step_s: measured seconds per batch (mean over ranks).
        predicted_s: seconds per batch the probe predicts (mean over ranks).
        threads: ``torch.get_num_threads()`` in this process.
        processes: processes of this job on this node.
        cores: cores this process may run on (:func:`available_cores`).
        factor: how many times the prediction a step must take to be reported.

    Example::

        >>> print(slow_step_message(0.3, 0.01, 2, 1, 2))  # doctest: +ELLIPSIS
        PerformanceMonitor: steps take 300 ms, 30x the 10.0 ms the matmul probe predicts ...

    """
    if threads <= 1 or predicted_s < MIN_PREDICTED_STEP_S or step_s <= factor * predicted_s:
        return None
    fix = suggested_threads(processes, cores)
    if threads * processes > cores:
        advice = f"more threads than cores: set OMP_NUM_THREADS={fix} (or torch.set_num_threads({fix}))"
    else:
        advice = (
            "other processes may be using these cores: try OMP_NUM_THREADS=1 (or torch.set_num_threads(1)); "
            "if that does not help, the model's many small operators are the likelier cause"
        )
    plural = "es" if processes != 1 else ""
    return (
        f"PerformanceMonitor: steps take {1e3 * step_s:.0f} ms, {step_s / predicted_s:.0f}x the "
        f"{1e3 * predicted_s:.1f} ms the matmul probe predicts for their FLOPs, with {threads} intra-op threads "
        f"x {processes} local process{plural} on {cores} cores: CPU threads are likely waiting for cores; "
        f"{advice} (said once)"
    )


class ThreadWatch:
    """PerformanceMonitor's two CPU thread verdicts, each warned at most once, on rank zero.

    :meth:`start` (at train start, after the launcher, the strategy and the module's ``setup`` have set the
    thread count) warns of more threads than cores; :meth:`judge` (on each reported window) warns, once
    :data:`SLOW_STEP_BATCHES` batches are measured, of steps far slower than the matmul probe predicts. Off
    CPU both do nothing: a GPU run's speed says nothing of its CPU threads.

    Example::

        watch = ThreadWatch()
        watch.start(trainer.strategy.root_device, trainer.num_devices)
        watch.judge(monitor.run_window)

    """

    def __init__(self) -> None:
        self.processes = 1  # processes of this job on this node
        self._cpu = False
        self._warned_threads = False
        self._judged = False

    def start(self, device: torch.device, num_devices: int) -> None:
        """Read the processes on this node and warn if their threads outnumber the cores (CPU runs only)."""
        self._cpu = device.type == "cpu"
        self.processes = local_processes(num_devices)
        if not self._cpu or self._warned_threads:
            return
        omp = os.environ.get("OMP_NUM_THREADS")
        message = oversubscription_message(torch.get_num_threads(), self.processes, available_cores(), omp)
        if message is not None:
            self._warned_threads = True
            rank_zero_warn(message)

    def judge(self, job: JobWindow | None) -> None:
        """Warn if the run's steps so far are over :data:`SLOW_STEP_FACTOR` x the probe's prediction (once)."""
        if not self._cpu or self._judged or job is None or job.ranks[0].batches < SLOW_STEP_BATCHES:
            return
        self._judged = True  # one verdict per run, warned or not
        if not all(w.batches and w.seconds and w.flops and w.measured_peak_flops for w in job.ranks):
            return  # no FLOP count or no probe: nothing predicted
        step = statistics.fmean(w.seconds / w.batches for w in job.ranks)
        # Each rank's counted FLOPs per batch at its own probe's FLOP/s: its step if it ran at the probe's rate.
        predicted = statistics.fmean(w.flops / w.batches / w.measured_peak_flops for w in job.ranks)
        message = slow_step_message(step, predicted, torch.get_num_threads(), self.processes, available_cores())
        if message is not None:
            rank_zero_warn(message)
