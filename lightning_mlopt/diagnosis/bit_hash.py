"""Bit-exact fingerprints of tensors, computed where the tensors live (no copy to the host).

A float norm is not bit-exact (two replicas that differ in one low bit can have the same norm); here each
tensor's bytes are read as integers of the same width and summed twice with wrap-around, plainly and
weighted by position, on the tensor's device. Any single changed bit changes the result (the arithmetic
wraps around, arranged so that a one-bit change never wraps to zero); the weighted sum catches values that
moved. One int64 per tensor; equal tensors always give equal fingerprints.

Example::

    >>> a = torch.tensor([1.0, 2.0, 3.0])
    >>> b = a.clone(); b.view(torch.int32)[1] ^= 1  # one flipped bit, invisible in a norm
    >>> bool(bit_hash(a) == bit_hash(b)), bool(torch.linalg.norm(a) == torch.linalg.norm(b))
    (False, True)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = 1_000_003  # odd, so the weighted sum is not absorbed by the plain one
# Elements per pass. The int64 words, weights and products of a pass are 3 x 32 MiB whatever the tensor's
# size: one pass over a 500M-element embedding would allocate 12 GB on a GPU that training has filled.
# Wrapping integer sums are exact, so the passes add up to the very value one pass would give.
CHUNK_ELEMENTS = 1 << 22


def integer_view(tensor: Tensor) -> Tensor:
    """``tensor`` flattened and read as integers of the same width (a view: writes go to ``tensor``)."""
    flat = tensor.detach().view(-1)
    if flat.dtype.is_floating_point or flat.dtype.is_complex or flat.dtype == torch.bool:
        return flat.view(_INTEGER_OF_WIDTH[flat.element_size()])
    return flat


def bit_hash(tensor: Tensor) -> Tensor:
    """A 0-dim int64 on ``tensor``'s device that changes when any bit of ``tensor`` changes (see module)."""
    words = integer_view(tensor.contiguous())
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), CHUNK_ELEMENTS):
        chunk = words[start : start + CHUNK_ELEMENTS].to(torch.int64)
        # Even weights (2, 4, ... by position in the whole tensor) and an odd mix: a change of 2**bit in one
        # word changes the result by 2**bit x (odd), which never wraps around to 0 in int64 arithmetic,
        # whatever the bit and the position.
        weights = torch.arange(
            2 * start + 2, 2 * (start + chunk.numel()) + 2, 2, device=chunk.device, dtype=torch.int64
        )
        total += chunk.sum() * _MIX + (chunk * weights).sum()
    return total


def bit_hashes(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """The fingerprints of ``tensors``, one int64 each, as one vector on ``device``."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.stack([bit_hash(tensor).to(device) for tensor in tensors])
