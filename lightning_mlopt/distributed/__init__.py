"""Small helpers that look through any strategy's sharding: full parameters, per-rank state bytes, norms."""

from lightning_mlopt.distributed.grad_norm import clip_grad_norm_, global_grad_norm
from lightning_mlopt.distributed.state import StateBytes, full_parameters, local_state_bytes

__all__ = ["StateBytes", "clip_grad_norm_", "full_parameters", "global_grad_norm", "local_state_bytes"]
