"""fp16: an overflow is the loss scaler's business, until the scale it overflowed at is already at the floor.

Under fp16 mixed precision the loss scaler (AMP's GradScaler) skips an update whose gradients overflowed and
halves its scale; a healthy run overflows now and then, mostly in its first steps (the scale starts at 65536).
A blow-up overflows at every scale: step after step the scaler skips and halves, and the run trains on nothing
while every step looks like the scaler's. So an overflow at a scale already at or below ``min_loss_scale``
(DeepSpeed's fp16 default floor is 1 too) is a non-finite step, reported as one.

Example::

    >>> floor = LossScaleFloor(min_loss_scale=1.0)
    >>> floor.overflowed(65536.0) is None     # the scaler skips it and halves its scale
    True
    >>> floor.overflowed(1.0).split(":")[1]   # at the floor: reported as a non-finite step
    ' the update overflowed at a loss scale of 1, at or below min_loss_scale (1), after 2 skipped updates in a row'
    >>> floor.stepped()                       # a finite step: the run of skips ends
    >>> floor.skipped_in_a_row
    0
"""

from __future__ import annotations


class LossScaleFloor:
    """The updates the loss scaler skipped in a row, and whether the last one overflowed at the floor.

    Args:
        min_loss_scale: the scale at or below which an overflow is a blow-up; None: every overflow is the
            scaler's (the behaviour before this check).

    """

    def __init__(self, min_loss_scale: float | None = 1.0) -> None:
        if min_loss_scale is not None and min_loss_scale <= 0:
            raise ValueError(f"min_loss_scale must be > 0 or null, got {min_loss_scale}")
        self.min_loss_scale = min_loss_scale
        self.skipped_in_a_row = 0

    def overflowed(self, scale: float) -> str | None:
        """An update overflowed at ``scale``: None (the scaler's to skip), or the report of a blow-up."""
        self.skipped_in_a_row += 1
        if self.min_loss_scale is None or scale > self.min_loss_scale:
            return None
        return (
            f"fp16: the update overflowed at a loss scale of {scale:g}, at or below min_loss_scale "
            f"({self.min_loss_scale:g}), after {self.skipped_in_a_row} skipped updates in a row: the gradients "
            "overflow whatever the scale (a blow-up, not fp16's range)"
        )

    def stepped(self) -> None:
        """A finite update: the run of skipped ones ends."""
        self.skipped_in_a_row = 0
