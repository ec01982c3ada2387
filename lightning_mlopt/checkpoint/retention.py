"""Which checkpoints to delete: keep the last K, every M-th step, and the best by a metric."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RetentionPolicy:
    """What to keep; everything else may be deleted (``checkpoint.keep`` in the CLI: its messages name those keys).

    Args:
        keep_last: the newest K checkpoints (at least 1).
        keep_every_n_steps: checkpoints whose step is a multiple of M are kept forever; None: none.
        keep_best: the K best by the monitored metric (0: none).
        mode: ``min`` or ``max``: which metric values are best.

    """

    keep_last: int = 3
    keep_every_n_steps: int | None = None
    keep_best: int = 1
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"keep.last must be >= 1 (the newest checkpoint is never deleted), got {self.keep_last}")
        if self.keep_every_n_steps is not None and self.keep_every_n_steps < 1:
            raise ValueError(f"keep.every_n_steps must be >= 1, got {self.keep_every_n_steps}")
        if self.keep_best < 0:
            raise ValueError(f"keep.best must be >= 0, got {self.keep_best}")

    def to_delete(self, checkpoints: Sequence[tuple[int, float | None]], protected: Sequence[int] = ()) -> list[int]:
        """Steps to delete among valid committed ``(step, metric value)``; ``protected`` steps never are.

        Example::

            >>> RetentionPolicy(keep_last=2, keep_best=0).to_delete([(1, None), (2, None), (3, None)])
            [1]
        """
        steps = sorted(step for step, _ in checkpoints)
        keep = set(steps[-self.keep_last :]) | set(protected)
        if self.keep_every_n_steps:
            keep |= {step for step in steps if step % self.keep_every_n_steps == 0}
        # A NaN would break the sort's order, and an infinite loss is no one's best: both count as no value.
        scored = [(value, step) for step, value in checkpoints if value is not None and math.isfinite(value)]
        if self.keep_best and scored:
            scored.sort(reverse=self.mode == "max")
            keep |= {step for _, step in scored[: self.keep_best]}
        return [step for step in steps if step not in keep]
