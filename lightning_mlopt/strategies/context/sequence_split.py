"""Each context rank's slice of a batch: every sequence tensor cut along dimension 1, the rest whole.

Every rank of a context group reads the same batch (the sampler counts data-parallel ranks only); rank ``r`` of
``P`` keeps positions ``[r S / P, (r + 1) S / P)`` of every tensor whose dimension 1 is the sequence (the
length of the batch's first tensor of two or more dimensions). Nothing is exchanged. The model must take its
positions from the batch (``position_key``), since ``arange(x.shape[1])`` inside it would number each slice
from 0: a batch without them is refused.

Example::

    inputs, targets, positions = split_sequences((inputs, targets, positions), rank=1, size=2, position_key=2)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_mlopt.exceptions import BadInputError


def split_sequences(batch: Any, rank: int, size: int, position_key: str | int) -> Any:
    """``batch`` (a tuple, list or dict of tensors) with every sequence tensor cut to rank ``rank``'s slice.

    Raises:
        BadInputError: no tensor of two or more dimensions, a sequence length ``size`` does not divide, or no
            positions under ``position_key``.

    """
    tensors = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
    length = next((t.shape[1] for t in tensors if isinstance(t, Tensor) and t.dim() >= 2), None)
    if length is None:
        raise BadInputError("context parallelism: the batch has no (batch, sequence, ...) tensor to split")
    if length % size:
        raise BadInputError(
            f"context parallelism: sequences of {length} positions do not split over context_parallel_size={size}; "
            "choose a sequence length (block size) it divides"
        )
    if not _has(batch, position_key):
        raise BadInputError(
            f"context parallelism: the batch has no positions under position_key={position_key!r}; each rank holds "
            "a slice of the sequence, so the model must take its positions from the batch (e.g. position_ids=, or "
            "the GPT demo's data.init_args.positions: true), not number them from 0 itself"
        )
    local = length // size

    def cut(value: Any) -> Any:
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == length:
            return value[:, rank * local : (rank + 1) * local]
        return value

    if isinstance(batch, Mapping):
        return {key: cut(value) for key, value in batch.items()}
    return type(batch)(cut(value) for value in batch)


def _has(batch: Any, key: str | int) -> bool:
    if isinstance(batch, Mapping):
        return key in batch
    return isinstance(key, int) and -len(batch) <= key < len(batch)


__all__ = ["split_sequences"]
