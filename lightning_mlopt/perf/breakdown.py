"""Per-rank step-time windows, summed over every rank in one exchange, and what they say about the job.

Each rank measures a window of batches (:class:`RankWindow`: seconds per phase, samples, FLOPs, peak memory)
and puts it in its own slot of a ``world x fields`` vector, so one sum over ranks gives every rank every
rank's window (:func:`pack` / :func:`unpack`). :class:`JobWindow` turns them into the logged metrics.

Example::

    ranks = unpack(summed_vector, world_size)
    job = JobWindow(ranks)
    job.metrics(published_peak=989.4e12)  # {"perf/samples_per_sec": ..., "perf/frac_data_wait": ..., ...}
    job.stalled_ranks(threshold=0.1)      # [1]
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, fields

from lightning_mlopt.process.phase import PHASES

GB = 1e9
BUBBLE_WARNING = 0.20
"""A pipeline bubble above this share of the step earns a warning with the fix (the seeds' rule)."""


@dataclass
class RankWindow:
    """What one rank measured over a window of batches (times in seconds, memory in bytes)."""

    seconds: float = 0.0
    data: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    loop: float = 0.0  # between batches, outside the dataloader (process/phase.py)
    checkpoint: float = 0.0
    batches: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0  # 0 when a sample's tokens are not known
    flops: float = 0.0  # model FLOPs done in the window; 0 when not counted
    measured_peak_flops: float = 0.0  # FLOP/s of this rank's matmul probe; 0 when not probed
    peak_allocated: float = 0.0
    peak_reserved: float = 0.0
    pipeline_idle: float = 0.0  # seconds a pipeline rank waited inside its schedule's steps (its bubble)
    pipeline_steps: float = 0.0  # seconds in those steps; 0 without pipeline parallelism

    def fraction(self, phase: str) -> float:
        """Share of the window's time spent in ``phase``."""
        return float(getattr(self, phase)) / self.seconds if self.seconds > 0 else 0.0

    def rate(self, items: str) -> float:
        """``samples`` or ``tokens`` per second."""
        return float(getattr(self, items)) / self.seconds if self.seconds > 0 else 0.0

    def add(self, other: RankWindow) -> None:
        """Extend this window by ``other`` (a later one): sums, peaks kept as maxima."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in _MAXIMA:
            setattr(self, name, max(getattr(self, name), getattr(other, name)))


_MAXIMA = ("measured_peak_flops", "peak_allocated", "peak_reserved")
FIELDS = tuple(field.name for field in fields(RankWindow))
_SUMMED = tuple(name for name in FIELDS if name not in _MAXIMA)


def pack(window: RankWindow, rank: int, world_size: int) -> list[float]:
    """A ``world_size x len(FIELDS)`` vector, zero but for ``rank``'s row: summed over ranks, every row fills."""
    values = [0.0] * (world_size * len(FIELDS))
    row = asdict(window)
    for index, name in enumerate(FIELDS):
        values[rank * len(FIELDS) + index] = float(row[name])
    return values


def unpack(values: list[float], world_size: int) -> list[RankWindow]:
    """Every rank's window from the summed vector of :func:`pack`."""
    width = len(FIELDS)
    return [RankWindow(*values[rank * width : (rank + 1) * width]) for rank in range(world_size)]


@dataclass
class JobWindow:
    """Every rank's window of the same batches."""

    ranks: list[RankWindow]

    def pooled(self, later: JobWindow) -> JobWindow:
        """A new window: this one extended by ``later``, rank by rank (neither is changed).

        Example::

            run = JobWindow([RankWindow()]).pooled(window)  # the run's window so far, plus this one
        """
        pool = JobWindow([RankWindow() for _ in self.ranks])
        for total, mine, theirs in zip(pool.ranks, self.ranks, later.ranks, strict=True):
            total.add(mine)
            total.add(theirs)
        return pool

    def stalled_ranks(self, threshold: float) -> list[int]:
        """Ranks that spent more than ``threshold`` of the window waiting for data."""
        return [rank for rank, window in enumerate(self.ranks) if window.fraction("data") > threshold]

    def slowest_rank(self) -> int:
        """The rank whose forward took longest: the one the others wait for.

        Forward time, because it is free of waiting under DDP and ZeRO-1/2 (their collectives run in backward
        and the optimizer step, and make those equally long on every rank); under FSDP and ZeRO-3 a forward
        also waits in parameter all-gathers, which blurs the difference.
        """
        per_batch = [w.forward / w.batches if w.batches else 0.0 for w in self.ranks]
        return max(range(len(per_batch)), key=per_batch.__getitem__)

    def mfu(self, peak_flops: float | None) -> float | None:
        """Model FLOPs utilization against a per-device peak: FLOP/s achieved over world x peak."""
        seconds = statistics.fmean(w.seconds for w in self.ranks)
        flops = sum(w.flops for w in self.ranks)
        if not peak_flops or seconds <= 0 or flops <= 0:
            return None
        return flops / seconds / (len(self.ranks) * peak_flops)

    def mfu_measured(self) -> float | None:
        """MFU against each rank's own measured matmul peak."""
        achieved = [w.flops / w.seconds for w in self.ranks if w.seconds > 0]
        peaks = [w.measured_peak_flops for w in self.ranks]
        if not achieved or not all(peaks) or sum(achieved) <= 0:
            return None
        return sum(achieved) / sum(peaks)

    def metrics(self, published_peak: float | None = None) -> dict[str, float]:
        """The ``perf/*`` metrics of this window (MFU left out here: :meth:`mfu` values are checked first)."""
        ranks = self.ranks
        metrics: dict[str, float] = {}
        for items in ("samples", "tokens"):
            rates = [w.rate(items) for w in ranks]
            if not any(rates):
                continue
            metrics[f"perf/{items}_per_sec"] = sum(rates)
            metrics[f"perf/{items}_per_sec_rank_min"] = min(rates)
            metrics[f"perf/{items}_per_sec_rank_median"] = statistics.median(rates)
            metrics[f"perf/{items}_per_sec_rank_max"] = max(rates)
        metrics["perf/step_time_s"] = statistics.fmean(w.seconds / w.batches if w.batches else 0.0 for w in ranks)
        for phase in PHASES:
            metrics[f"perf/frac_{_NAMES[phase]}"] = statistics.fmean(w.fraction(phase) for w in ranks)
        waits = [w.fraction("data") for w in ranks]
        metrics["perf/frac_data_wait_max"] = max(waits)
        metrics["perf/data_wait_max_rank"] = float(waits.index(max(waits)))
        metrics["perf/slowest_rank"] = float(self.slowest_rank())
        peaks = [w.peak_allocated for w in ranks]
        metrics["perf/peak_memory_gb"] = max(peaks) / GB
        metrics["perf/peak_memory_gb_min"] = min(peaks) / GB
        metrics["perf/peak_memory_rank"] = float(peaks.index(max(peaks)))
        if any(w.peak_reserved != w.peak_allocated for w in ranks):
            metrics["perf/peak_reserved_gb"] = max(w.peak_reserved for w in ranks) / GB
        achieved = [w.flops / w.seconds for w in ranks if w.seconds > 0 and w.flops > 0]
        if achieved:
            metrics["perf/tflops_per_rank"] = statistics.fmean(achieved) / 1e12
        bubbles = self.pipeline_bubbles()
        if bubbles:
            metrics["perf/pipeline_bubble"] = statistics.fmean(bubbles)
            metrics["perf/pipeline_bubble_max"] = max(bubbles)
            metrics["perf/pipeline_bubble_max_rank"] = float(bubbles.index(max(bubbles)))
        return metrics

    def pipeline_bubbles(self) -> list[float]:
        """Each rank's idle share of its pipeline steps; empty without pipeline parallelism."""
        if not any(w.pipeline_steps for w in self.ranks):
            return []
        return [w.pipeline_idle / w.pipeline_steps if w.pipeline_steps else 0.0 for w in self.ranks]

    def table(self) -> str:
        """One line per rank: throughput and where its time went."""
        head = "rank  samples/s  step ms  " + "  ".join(f"{_NAMES[p]:>10}" for p in PHASES) + "  peak GB"
        rows = [head]
        for rank, w in enumerate(self.ranks):
            step_ms = 1e3 * w.seconds / w.batches if w.batches else 0.0
            shares = "  ".join(f"{100 * w.fraction(p):>9.1f}%" for p in PHASES)
            peak = w.peak_allocated / GB
            rows.append(f"{rank:>4}  {w.rate('samples'):>9.1f}  {step_ms:>7.1f}  {shares}  {peak:>7.2f}")
        return "\n".join(rows)


# The phase names of process/phase.py as metrics call them ("data" is time waiting for data).
_NAMES = {phase: "data_wait" if phase == "data" else phase for phase in PHASES}
