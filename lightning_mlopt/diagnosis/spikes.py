"""A loss or gradient norm far above its recent history: a spike, judged the same on every rank."""

from __future__ import annotations

import math
from collections import deque
from typing import Any


class SpikeDetector:
    """Rolling mean and standard deviation of the loss and the gradient norm over the last ``window`` steps.

    A value more than ``threshold`` standard deviations above its mean is a spike (once ``min_history`` steps
    are known). Spikes are not added to the history, so one bad step does not widen what counts as normal.
    The history is checkpointed (:meth:`state_dict`): a resumed run keeps judging against it.

    Args:
        window: steps of history.
        threshold: standard deviations above the mean that count as a spike.
        min_history: steps of history before anything is judged.

    Example::

        >>> detector = SpikeDetector(window=10, threshold=3.0, min_history=3)
        >>> for loss in (1.0, 1.1, 0.9):
        ...     detector.observe(loss, 2.0)
        >>> detector.observe(5.0, 2.0)
        'loss spike: 5 is more than 3 standard deviations above the mean 1 (std 0.1) of the last 3 steps'
        >>> detector.events
        1

    """

    def __init__(self, window: int = 100, threshold: float = 6.0, min_history: int = 20) -> None:
        if window < 2:
            raise ValueError(f"spike_window must be >= 2, got {window}")
        if threshold <= 0:
            raise ValueError(f"spike_threshold must be > 0, got {threshold}")
        if min_history > window:  # the history holds `window` values: nothing would ever be judged
            raise ValueError(
                f"spike_min_history ({min_history}) must be <= spike_window ({window}): the history holds "
                f"{window} steps, so a spike would never be judged"
            )
        self.window = window
        self.threshold = threshold
        self.min_history = min_history
        self.loss_history: deque[float] = deque(maxlen=window)
        self.norm_history: deque[float] = deque(maxlen=window)
        self.events = 0

    def observe(self, loss: float, norm: float) -> str | None:
        """Judge this step's values; return what spiked (and count it), or None and remember them."""
        spike = self._judge(loss, norm)
        if spike:
            self.events += 1
        else:
            self.loss_history.append(loss)
            self.norm_history.append(norm)
        return spike

    def _judge(self, loss: float, norm: float) -> str | None:
        for label, value, history in (("loss", loss, self.loss_history), ("gradient norm", norm, self.norm_history)):
            if len(history) < max(2, self.min_history):
                continue
            mean = sum(history) / len(history)
            std = math.sqrt(sum((x - mean) ** 2 for x in history) / (len(history) - 1))
            if value > mean + self.threshold * max(std, 1e-12):
                return (
                    f"{label} spike: {value:.4g} is more than {self.threshold:g} standard deviations above "
                    f"the mean {mean:.4g} (std {std:.3g}) of the last {len(history)} steps"
                )
        return None

    def state_dict(self) -> dict[str, Any]:
        """The history and the event count, as JSON-able values."""
        return {"loss_history": list(self.loss_history), "norm_history": list(self.norm_history), "events": self.events}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values; missing keys (an older checkpoint) leave an empty history."""
        self.loss_history = deque(state.get("loss_history", []), maxlen=self.window)
        self.norm_history = deque(state.get("norm_history", []), maxlen=self.window)
        self.events = state.get("events", 0)
