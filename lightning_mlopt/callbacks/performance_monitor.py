# long: the hooks that feed every phase of every rank's step to perf/, where the arithmetic lives
"""PerformanceMonitor: where each rank's step time and memory go, throughput, input stalls and MFU."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_mlopt._compat import defer_progress_bar_scalars, lightning_row_step
from lightning_mlopt._metrics import log_metrics, logging_period
from lightning_mlopt.callbacks.phase_markers import PhaseMarkers
from lightning_mlopt.callbacks.throughput_progress_bar import count_samples
from lightning_mlopt.distributed.sharding import data_parallel_size
from lightning_mlopt.hooks import DescribesOutputs, pipeline_of
from lightning_mlopt.perf.breakdown import BUBBLE_WARNING, FIELDS, JobWindow, RankWindow, pack, unpack
from lightning_mlopt.perf.compile_watch import CompilingBatches, compile_record
from lightning_mlopt.perf.flops import TrainingFlopCounter
from lightning_mlopt.perf.memory import OOMSnapshot, peak_memory_bytes
from lightning_mlopt.perf.peaks import matmul_precision, measure_peak_flops, published_peak_flops
from lightning_mlopt.perf.phase_clock import PhaseClock
from lightning_mlopt.perf.thread_watch import ThreadWatch
from lightning_mlopt.perf.trace import ProfilerWindow, check_window
from lightning_mlopt.perf.window_sum import WindowSum
from lightning_mlopt.process.phase import PHASES, phase
from lightning_mlopt.run_dir import PERF_DIR, PERF_SUMMARY_NAME


class PerformanceMonitor(PhaseMarkers, DescribesOutputs):
    """Measures every rank's step: time per phase, throughput, input stalls, MFU and peak memory.

    Every rank times its own batches by phase (``process/phase.py``: data wait, forward, backward,
    optimizer, checkpoint); on CUDA with CUDA events, read only on logging steps, so no other step waits for
    the GPU. On logging steps (every ``log_every_n_steps`` optimizer steps) the window since the last one is
    summed over every rank without a collective of its own: it rides in the step exchange another callback
    makes anyway (FaultTolerantCheckpoint's vote in every CLI run), or else is summed in the background on a
    gloo group of its own (``perf/window_sum.py``); no rank waits for it. A batch or two later rank zero logs
    the window, labelled with its own step, through the trainer's loggers:

    - ``perf/samples_per_sec`` (the job's) and ``perf/samples_per_sec_rank_min|median|max``; the same for
      ``tokens`` when ``tokens_per_sample`` is given or the LightningModule has a ``tokens_per_sample``
      attribute;
    - ``perf/frac_data_wait`` (from the loop asking the dataloader for a batch to the batch's start),
      ``perf/frac_forward``, ``perf/frac_backward``, ``perf/frac_optimizer``, ``perf/frac_loop`` (between
      batches outside the dataloader: Lightning's loop, logging, other callbacks' batch-end hooks),
      ``perf/frac_checkpoint`` (fractions of the step, mean over ranks), ``perf/frac_data_wait_max`` and its
      rank ``perf/data_wait_max_rank``, ``perf/step_time_s``, and ``perf/slowest_rank`` (longest forward);
    - ``perf/mfu`` against the device's published dense peak for the run's precision (only for boards in
      ``perf/peaks.py``), ``perf/mfu_measured`` against a matmul probe run at start on every rank (CPUs too),
      ``perf/tflops_per_rank``. FLOPs are counted on the first batch with torch's FLOP counter (forward and
      backward) unless ``flops_per_sample`` is given. An MFU above 1 means the count is wrong: it is reported
      as such and not logged. Under tensor parallelism the ranks of a group share a batch: samples and tokens
      count once per group, and each rank counts the FLOPs of its own pieces;
    - ``perf/peak_memory_gb`` (max over ranks), ``perf/peak_memory_gb_min``, ``perf/peak_memory_rank``, and
      ``perf/peak_reserved_gb`` on CUDA. On CPU the peak is the process's resident set.

    When a rank waits for data more than ``stall_threshold`` of the step over a window of at least
    ``stall_window`` batches (the logging windows, pooled until they are that long), a warning names the
    rank(s), the fraction and the dataloader settings to change, once per run for each set of stalled ranks
    (a stall that comes back after each epoch's start is one finding; ``perf/frac_data_wait`` tracks it). On CPU, more
    threads than cores, and steps far slower than the matmul probe predicts, get a warning each (``thread_watch``).
    The first batch (start-up, FLOP counting), a batch that compiled (torch.compile) with its window's batches before
    it, validation, and the monitor's own work (its exchange on logging steps, writing a trace) are in no figure. At
    the end rank zero writes the run's figures (and what compiling cost) to ``<run_dir>/perf/summary.json``.

    ``profile_steps: [start, stop]`` records optimizer steps ``start`` to ``stop - 1`` with torch.profiler on
    every rank, writes ``<run_dir>/perf/trace-rank<R>.json.gz`` (at most 20 steps; gzip; no shapes or stacks)
    and prints each rank's top operators. On CUDA, an out-of-memory error writes the rank's allocation history
    (the newest ``oom_snapshot_entries``) to ``<run_dir>/perf/oom-rank<R>.pickle`` and names it in the error.

    Args:
        log_every_n_steps: measure and log every N optimizer steps; None: ``trainer.log_every_n_steps``.
        stall_threshold: fraction of a step spent waiting for data above which a rank is input-stalled.
        stall_window: fewest batches an input-stall verdict is drawn from (fewer are too noisy).
        tokens_per_sample: tokens in one sample, for ``perf/tokens_per_sec``; None: the module's attribute.
        flops_per_sample: model FLOPs of one sample's forward and backward; None: counted on the first batch.
        count_flops: count FLOPs on the first batch when ``flops_per_sample`` is None (False: no MFU).
        measure_peak: run the matmul probe at the start of training (about 0.2 s) for ``perf/mfu_measured``.
        profile_steps: ``[start, stop]`` optimizer steps to record with torch.profiler; None: no trace.
        oom_snapshot_entries: CUDA allocations remembered for the out-of-memory snapshot; 0: none.

    Example::

        trainer = Trainer(callbacks=[PerformanceMonitor(profile_steps=[10, 13])], log_every_n_steps=50)

    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        stall_threshold: float = 0.1,
        stall_window: int = 10,
        tokens_per_sample: int | None = None,
        flops_per_sample: float | None = None,
        count_flops: bool = True,
        measure_peak: bool = True,
        profile_steps: list[int] | None = None,
        oom_snapshot_entries: int = 100_000,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        if not 0.0 < stall_threshold < 1.0:
            raise ValueError(f"stall_threshold must be in (0, 1), got {stall_threshold}")
        if stall_window < 1:
            raise ValueError(f"stall_window must be >= 1, got {stall_window}")
        if tokens_per_sample is not None and tokens_per_sample < 1:
            raise ValueError(f"tokens_per_sample must be >= 1, got {tokens_per_sample}")
        if flops_per_sample is not None and flops_per_sample <= 0:
            raise ValueError(f"flops_per_sample must be > 0, got {flops_per_sample}")
        if profile_steps is not None:
            if len(profile_steps) != 2:
                raise ValueError(f"profile_steps must be [start, stop], got {profile_steps}")
            check_window(*profile_steps)
        if oom_snapshot_entries < 0:
            raise ValueError(f"oom_snapshot_entries must be >= 0, got {oom_snapshot_entries}")
        self.log_every_n_steps = log_every_n_steps
        self.stall_threshold = stall_threshold
        self.stall_window = stall_window
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample = flops_per_sample
        self.count_flops = count_flops
        self.measure_peak = measure_peak
        self.profile_steps = profile_steps
        self.oom_snapshot_entries = oom_snapshot_entries
        self.last_metrics: dict[str, float] = {}
        self.stalled: list[int] = []  # the ranks stalled in the newest judged window
        self._warned_stalls: set[tuple[int, ...]] = set()
        self._stall_pool: JobWindow | None = None
        self.run_window: JobWindow | None = None  # the whole run so far, every rank (after each exchange)
        self._clock: PhaseClock | None = None
        self._sums: WindowSum | None = None
        self._window = RankWindow()
        self._batches = 0
        self._compiling = CompilingBatches()  # a batch that compiled (torch.compile) is in no figure
        self._counter: TrainingFlopCounter | None = None
        # FLOPs this rank does per sample it computes on: counted, or flops_per_sample split over the ranks
        # that share a batch (tensor parallelism).
        self._flops_per_sample: float | None = flops_per_sample
        self._ranks_per_batch = 1  # ranks computing on one batch together (a tensor-parallel group)
        self._tokens: int | None = None
        self._measured_peak = 0.0
        self._published_peak: float | None = None
        self._device_name = "cpu"
        self._precision = "fp32"
        self._profiler: ProfilerWindow | None = None
        self._oom: OOMSnapshot | None = None
        self._warned_counting = False
        self._warned_bubble = False
        self._threads = ThreadWatch()  # on CPU: more threads than cores, steps far off the probe's prediction
        self._bubble_theory: float | None = None  # the pipeline schedule's, logged beside the measured bubble

    def folder(self, trainer: pl.Trainer) -> Path:
        """Where traces, snapshots and the summary go: ``<trainer.default_root_dir>/perf``."""
        return Path(trainer.default_root_dir) / PERF_DIR

    def describe_outputs(self, trainer: pl.Trainer) -> list[str]:
        """Where the summary and traces go (the CLI's start-up lines)."""
        traces = f", traces of steps {self.profile_steps}" if self.profile_steps else ""
        return [f"performance  {self.folder(trainer)} (summary.json at the end{traces}; perf/* logged)"]

    # ------------------------------------------------------------------ start

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # A model's `prog_bar=True` metrics would otherwise be read on the host after every batch, bar or none.
        defer_progress_bar_scalars()
        folder, rank = self.folder(trainer), trainer.global_rank
        self._oom = OOMSnapshot(folder / f"oom-rank{rank}.pickle", self.oom_snapshot_entries)
        self._oom.start()  # before the model reaches the GPU, so its allocations are in the history
        if self.profile_steps is not None:
            start, stop = self.profile_steps
            self._profiler = ProfilerWindow(start, stop, folder, rank)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        self._precision = matmul_precision(str(trainer.precision))
        if device.type == "cuda":
            self._device_name = torch.cuda.get_device_name(device)
            self._published_peak = published_peak_flops(self._device_name, self._precision)
        if self.measure_peak:
            self._measured_peak = measure_peak_flops(device, self._precision)
        self._tokens = self.tokens_per_sample or getattr(pl_module, "tokens_per_sample", None)
        self._ranks_per_batch = trainer.world_size // data_parallel_size(trainer.strategy, trainer.world_size)
        if self.flops_per_sample is not None:
            self._flops_per_sample = self.flops_per_sample / self._ranks_per_batch
        self._clock = PhaseClock(device).attach()
        self._sums = WindowSum(trainer)
        self._batches = 0
        pipeline = pipeline_of(trainer.strategy)
        self._bubble_theory = None if pipeline is None else pipeline.theoretical_bubble
        self._threads.start(device, trainer.num_devices)

    # ------------------------------------------------------------------ every batch

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        super().on_train_batch_start(trainer, pl_module, *args)
        self._compiling.started()
        if self._batches == 0 and self._flops_per_sample is None and self.count_flops:
            self._counter = TrainingFlopCounter().__enter__()
        if self._profiler is not None:
            self._profiler.batch_starting(trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        with phase("monitor"):  # its own work is in no figure
            self._batch_ended(trainer, count_samples(batch))

    def _batch_ended(self, trainer: pl.Trainer, samples: int) -> None:
        """Count one batch of ``samples`` this rank computed on (its FLOPs are its own work, counted locally).

        The ranks of a tensor-parallel group compute on the same batch: each counts its share of the samples,
        so the job's sum is the data it trained on, while each counts the FLOPs it did itself.
        """
        self._batches += 1
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._flops_per_sample = self._counter.total / max(samples, 1) if self._counter.total else None
            self._counter = None
        if self._profiler is not None:
            self._report_trace(trainer, self._profiler.batch_ended(trainer.global_step))
        if self._clock is None:
            return
        assert self._sums is not None
        for values, step in self._sums.arrived():
            self._take_in(trainer, values, step)
        if self._batches == 1 or self._compiling.compiled():
            # The first batch (start-up, FLOP counting) and a window with a batch that compiled are in no figure.
            self._clock.reset()
            self._window = RankWindow()
            if (pipeline := pipeline_of(trainer.strategy)) is not None:
                pipeline.bubble_clock.take()
            return
        window = self._window
        window.batches += 1
        share = samples / self._ranks_per_batch
        window.samples += share
        window.tokens += share * (self._tokens or 0)
        window.flops += samples * (self._flops_per_sample or 0.0)
        every = logging_period(self.log_every_n_steps, trainer)
        if (self._batches - 1) % (every * trainer.accumulate_grad_batches) == 0:
            self._close_window(trainer)

    # ------------------------------------------------------------------ every logging step

    def _close_window(self, trainer: pl.Trainer) -> None:
        """End this rank's window and submit it to be summed with every rank's (``perf/window_sum.py``)."""
        assert self._clock is not None and self._sums is not None
        window, self._window = self._window, RankWindow()
        for name, seconds in self._clock.take().items():  # on CUDA: the one wait for the GPU, here
            if name in FIELDS:
                setattr(window, name, seconds)
        window.seconds = sum(getattr(window, name) for name in PHASES)  # the step's phases, nothing else
        window.measured_peak_flops = self._measured_peak
        window.peak_allocated, window.peak_reserved = map(float, peak_memory_bytes(trainer.strategy.root_device))
        pipeline = pipeline_of(trainer.strategy)
        if pipeline is not None:
            window.pipeline_idle, window.pipeline_steps = pipeline.bubble_clock.take()
        self._sums.submit(pack(window, trainer.global_rank, trainer.world_size), lightning_row_step(trainer))

    def _take_in(self, trainer: pl.Trainer, values: list[float], step: int, report: bool = True) -> None:
        """Every rank's window, summed: into the run's totals, and reported (logged with its own step)."""
        job = JobWindow(unpack(values, trainer.world_size))
        self._accumulate(job)
        if report:
            self._report(trainer, job, step)

    def _accumulate(self, job: JobWindow) -> None:
        self.run_window = job if self.run_window is None else self.run_window.pooled(job)

    def metrics_of(self, job: JobWindow) -> dict[str, float]:
        """A window's ``perf/*`` metrics, MFU included where it is a possible value."""
        metrics = job.metrics()
        for key, value in (("perf/mfu", job.mfu(self._published_peak)), ("perf/mfu_measured", job.mfu_measured())):
            if value is None:
                continue
            if value > 1.0:
                self._warn_counting(key, value)
                continue
            metrics[key] = value
        if self._bubble_theory is not None and "perf/pipeline_bubble" in metrics:
            metrics["perf/pipeline_bubble_theory"] = self._bubble_theory
        return metrics

    def _warn_counting(self, key: str, value: float) -> None:
        if not self._warned_counting:
            self._warned_counting = True
            rank_zero_warn(
                f"PerformanceMonitor: {key} came out at {value:.2f}, above 1: the FLOPs per sample "
                f"({self._flops_per_sample:.3g}) are overcounted (a flops_per_sample that counts the global "
                "batch, or activation recomputation counted); not logged"
            )

    def _report(self, trainer: pl.Trainer, job: JobWindow, step: int) -> None:
        self.last_metrics = self.metrics_of(job)
        self._check_bubble(trainer, job)
        self._threads.judge(self.run_window)
        self._stall_pool = job if self._stall_pool is None else self._stall_pool.pooled(job)
        if self._stall_pool.ranks[0].batches >= self.stall_window:
            self._check_stalls(self._stall_pool)
            self._stall_pool = None
        log_metrics(trainer, self.last_metrics, step)

    def _check_bubble(self, trainer: pl.Trainer, job: JobWindow) -> None:
        """Warn once when the pipeline ranks idle over 20% of their steps, with the fix."""
        pipeline = pipeline_of(trainer.strategy)
        bubbles = job.pipeline_bubbles()
        if pipeline is None or not bubbles:
            return
        measured = statistics.fmean(bubbles)
        if measured > BUBBLE_WARNING and not self._warned_bubble:
            self._warned_bubble = True
            worst = bubbles.index(max(bubbles))
            rank_zero_warn(f"PerformanceMonitor: {pipeline.bubble_advice(measured, worst)}")

    def _check_stalls(self, job: JobWindow) -> None:
        stalled = job.stalled_ranks(self.stall_threshold)
        if stalled and tuple(stalled) not in self._warned_stalls:
            self._warned_stalls.add(tuple(stalled))
            waits = ", ".join(f"rank {rank} {100 * job.ranks[rank].fraction('data'):.0f}%" for rank in stalled)
            rank_zero_warn(
                f"PerformanceMonitor: input-stalled: time waiting for data over the last "
                f"{int(job.ranks[0].batches)} batches: {waits} of the step (threshold "
                f"{100 * self.stall_threshold:.0f}%). The dataloader cannot keep up: raise num_workers, set "
                "pin_memory=True (GPU), prefetch_factor and persistent_workers=True, or make the dataset's "
                "__getitem__ and collate cheaper (said once for these ranks; perf/frac_data_wait follows it)"
            )
        self.stalled = stalled

    def _report_trace(self, trainer: pl.Trainer, path: Path | None) -> None:
        if path is None or self._profiler is None:
            return
        print(
            f"rank {trainer.global_rank}: profiler trace of steps {self._profiler.start}-{self._profiler.stop - 1}"
            f" written to {path}; top operators:\n{self._profiler.top_operators}",
            flush=True,
        )

    # ------------------------------------------------------------------ end

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._profiler is not None:
            self._report_trace(trainer, self._profiler.finish())
        if self._clock is None:
            return
        assert self._sums is not None
        with phase("monitor"):
            for values, step in self._sums.drain():
                self._take_in(trainer, values, step)
            if self._window.batches:  # the batches after the last logging step: into the summary only
                self._close_window(trainer)
                for values, step in self._sums.drain():
                    self._take_in(trainer, values, step, report=False)
            self._sums.close()
        self._clock.detach()
        if trainer.is_global_zero and self.run_window is not None:
            self.write_summary(trainer, self.folder(trainer) / PERF_SUMMARY_NAME)

    def write_summary(self, trainer: pl.Trainer, path: Path) -> None:
        """The whole run's figures as JSON: per-rank windows, metrics, FLOPs and peaks (rank zero)."""
        assert self.run_window is not None
        summary = {
            "world_size": trainer.world_size,
            "device": self._device_name,
            "precision": self._precision,
            "flops_per_sample": self._flops_per_sample,
            "published_peak_flops": self._published_peak,
            "stall_threshold": self.stall_threshold,
            "metrics": self.metrics_of(self.run_window),
            "ranks": [vars(window) for window in self.run_window.ranks],
            "compile": None if (compiled := compile_record()) is None else compiled.as_dict(),  # with CompileModel
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._oom is not None and isinstance(exception, torch.cuda.OutOfMemoryError):
            self._oom.write_for(exception)
        self._stop()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(*sys.exc_info())
            self._counter = None
        if self._clock is not None:
            self._clock.detach()
        if self._oom is not None:
            self._oom.stop()
