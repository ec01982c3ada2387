"""Each context rank's slice of a batch: every sequence tensor cut along dimension 1, the rest whole.

Every rank of a context group reads the same batch (the sampler counts data-parallel ranks only); rank ``r`` of
``P`` keeps positions ``[r S / P, (r + 1) S / P)`` of every tensor whose dimension 1 is the sequence (the
length of the batch's first tensor of two or more dimensions). Nothing is exchanged. The model must take its
positions from the batch (``position_key``), since ``arange(x.shape[1])`` inside it would number each slice
from 0: a batch without them is refused.

Example::

    inputs, targets, positions = split_sequences((inputs, targets, positions), rank=1, size=2, position_key=2)
    weight = token_weight(batch_dict, rank=1, size=2)  # its mean loss's share of the per-token mean
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


def token_weight(batch: Any, rank: int, size: int, labels_key: str = "labels", ignore_index: int = -100) -> float:
    """How much rank ``rank``'s mean loss weighs so that the ranks' average is the mean over every labelled token.

    A dict batch's ``labels`` may ignore tokens (``ignore_index``: padding, prompts), so the slices hold unequal
    counts of the tokens a loss averages over; rank ``r``'s mean, times ``n_r x size / n``, averages over the
    ranks (as FSDP averages gradients) to the whole batch's per-token mean. 1.0 for a batch without labels
    (every token counts, the slices are equal). Computed on the whole batch: every rank gets the same answer.

    Raises:
        BadInputError: a slice has no labelled token (its mean would be NaN, and so every gradient).

    Example::

        >>> import torch
        >>> labels = torch.tensor([[-100, 4, 5, 6]])  # slice 0 holds one labelled token, slice 1 two
        >>> token_weight({"labels": labels}, rank=1, size=2)
        1.3333333333333333

    """
    labels = batch.get(labels_key) if isinstance(batch, Mapping) else None
    if not isinstance(labels, Tensor) or labels.dim() < 2 or labels.shape[1] % size:
        return 1.0
    counted = (labels != ignore_index).reshape(labels.shape[0], size, -1).sum(dim=(0, 2))
    if bool((counted == 0).any()):
        raise BadInputError(
            f"context parallelism: a slice of a batch has no label other than {ignore_index} (ignored), so its mean "
            "loss is NaN; batch sequences whose labelled tokens reach every slice, or train without "
            "context_parallel_size"
        )
    return int(counted[rank]) * size / int(counted.sum())


def _has(batch: Any, key: str | int) -> bool:
    if isinstance(batch, Mapping):
        return key in batch
    return isinstance(key, int) and -len(batch) <= key < len(batch)


__all__ = ["split_sequences", "token_weight"]
