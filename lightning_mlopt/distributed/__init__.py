"""Small helpers that look through any strategy's sharding: full parameters, per-rank state bytes, norms.

The names below load on first use (PEP 562): ``phase`` and the start-up helpers are stdlib-only and are
imported by the entry point before torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_mlopt.distributed.grad_norm import clip_grad_norm_, global_grad_norm
    from lightning_mlopt.distributed.state import StateBytes, full_parameters, local_state_bytes

_WHERE = {
    "clip_grad_norm_": "grad_norm",
    "global_grad_norm": "grad_norm",
    "StateBytes": "state",
    "full_parameters": "state",
    "local_state_bytes": "state",
}

__all__ = ["StateBytes", "clip_grad_norm_", "full_parameters", "global_grad_norm", "local_state_bytes"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
