"""Every random-number generator a training step touches: Python, NumPy, torch CPU and CUDA."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """The current state of every RNG of this process (CUDA for each visible device)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put every RNG back to a captured state (CUDA only where it was captured and a GPU is present)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
