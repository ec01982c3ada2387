"""The two all-to-all exchanges of context parallelism: a slice of the sequence for a slice of the heads, and back.

With ``P`` context ranks each holding ``S / P`` positions of every head, :func:`heads_to_sequence` gives each rank
``H / P`` heads over all ``S`` positions (rank ``r`` the ``r``-th group of heads, positions in rank order), and
:func:`sequence_to_heads` undoes it. Both are differentiable (their backward is the other exchange) and run on gloo
as on NCCL.

Example::

    q = heads_to_sequence(q, group)                         # (B, H, S/P, D) -> (B, H/P, S, D)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = sequence_to_heads(out, group)                     # (B, H/P, S, D) -> (B, H, S/P, D)
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_mlopt._compat import all_to_all_autograd


def heads_to_sequence(x: Tensor, group: Any) -> Tensor:
    """``(B, H, S/P, D)`` -> ``(B, H/P, S, D)`` over ``group``'s ``P`` ranks (``H`` divisible by ``P``)."""
    size = dist.get_world_size(group)
    batch, heads, local, dim = x.shape
    # Chunk i of dim 0 goes to rank i: head group i of this rank's positions.
    outgoing = x.reshape(batch, size, heads // size, local, dim).permute(1, 0, 2, 3, 4).contiguous()
    incoming = all_to_all_autograd(outgoing, group)  # chunk j from rank j: positions j of this rank's head group
    return incoming.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * local, dim)


def sequence_to_heads(x: Tensor, group: Any) -> Tensor:
    """``(B, H/P, S, D)`` -> ``(B, H, S/P, D)``: the inverse of :func:`heads_to_sequence`."""
    size = dist.get_world_size(group)
    batch, heads, length, dim = x.shape
    local = length // size
    # Chunk i of dim 0 goes to rank i: its positions, of this rank's head group.
    outgoing = x.reshape(batch, heads, size, local, dim).permute(2, 0, 1, 3, 4).contiguous()
    incoming = all_to_all_autograd(outgoing, group)  # chunk j from rank j: head group j of this rank's positions
    return incoming.permute(1, 0, 2, 3, 4).reshape(batch, size * heads, local, dim)


__all__ = ["heads_to_sequence", "sequence_to_heads"]
