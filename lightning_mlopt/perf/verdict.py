"""What a profile measured, and what it says: input-, communication- or compute-bound; scaling efficiency.

Example::

    >>> scaling_efficiency({1: 100.0, 2: 180.0, 4: 300.0})
    {1: 1.0, 2: 0.9, 4: 0.75}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

INPUT_CEILING_RATIO = 1.2  # a loader at most this much faster than training cannot keep it fed through jitter
SCALING_FLOOR = 0.8  # scaling efficiency below this is flagged


def scaling_efficiency(throughput: dict[int, float]) -> dict[int, float]:
    """``throughput(N) / (N x throughput(1))`` for each process count N (the smallest count stands for 1).

    With a smallest count ``b`` other than 1, per-process throughput is compared with ``b``'s:
    ``(throughput(N) / N) / (throughput(b) / b)``.
    """
    if not throughput:
        return {}
    base = min(throughput)
    per_process = throughput[base] / base
    return {n: round(value / (n * per_process), 6) if per_process > 0 else 0.0 for n, value in throughput.items()}


@dataclass
class Verdict:
    """What bounds the run, and the numbers that decided it."""

    kind: str  # "input-bound", "communication-bound" or "compute-bound"
    reasons: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.kind}: " + "; ".join(self.reasons)


def decide(train: dict[str, Any], loader: dict[str, Any] | None, efficiency: dict[int, float] | None = None) -> Verdict:
    """The verdict from a training run's summary, the loader-only run's, and the scaling efficiency.

    Input-bound when the loader alone is within ``INPUT_CEILING_RATIO`` of training throughput or any rank
    waits for data more than the monitor's stall threshold. Otherwise communication-bound when scaling was
    measured and the largest process count falls below ``SCALING_FLOOR`` (exposed communication, or ranks
    contending for a shared host; host-side timing cannot see overlapped communication). Otherwise
    compute-bound.
    """
    metrics = train["metrics"]
    training = metrics["perf/samples_per_sec"]
    wait, wait_rank = metrics["perf/frac_data_wait_max"], int(metrics["perf/data_wait_max_rank"])
    threshold = train.get("stall_threshold", 0.1)
    ceiling = loader["metrics"]["perf/samples_per_sec"] if loader else None
    ratio = ceiling / training if ceiling and training > 0 else None
    ceiling_text = (
        f"loader-only ceiling {ceiling:.1f} samples/s is {ratio:.2f}x training's {training:.1f}"
        if ratio is not None
        else "no loader-only ceiling"
    )
    wait_text = f"data wait up to {100 * wait:.1f}% of the step (rank {wait_rank}; threshold {100 * threshold:.0f}%)"
    if (ratio is not None and ratio < INPUT_CEILING_RATIO) or wait > threshold:
        return Verdict("input-bound", [ceiling_text, wait_text])
    if efficiency:
        largest = max(efficiency)
        if efficiency[largest] < SCALING_FLOOR:
            return Verdict(
                "communication-bound",
                [
                    f"scaling efficiency {100 * efficiency[largest]:.0f}% at {largest} processes "
                    f"(below {100 * SCALING_FLOOR:.0f}%: exposed communication, or processes sharing a host's "
                    "cores or memory bandwidth)",
                    ceiling_text,
                    wait_text,
                ],
            )
    busy = sum(metrics.get(f"perf/frac_{name}", 0.0) for name in ("forward", "backward", "optimizer"))
    reasons = [f"forward, backward and optimizer take {100 * busy:.0f}% of the step", ceiling_text, wait_text]
    if efficiency:
        largest = max(efficiency)
        reasons.append(f"scaling efficiency {100 * efficiency[largest]:.0f}% at {largest} processes")
    return Verdict("compute-bound", reasons)
