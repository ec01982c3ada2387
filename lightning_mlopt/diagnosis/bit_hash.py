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
# Elements per pass, by device type. Each pass widens its words into int64 buffers allocated once per call
# and reused, so memory stays at 3 buffers of a pass whatever the tensor's size (one pass over a 500M-element
# embedding would allocate 12 GB on a GPU that training has filled), and no pass allocates (on CPU, fresh
# temporaries of tens of MB cost more in page faults than the arithmetic: 5.9 ms per million elements at
# 39M, against 0.55 in passes that stay in cache). Wrapping integer sums are exact: the passes add up to the
# value one pass would give.
CHUNK_ELEMENTS = {"cpu": 1 << 18}
DEFAULT_CHUNK_ELEMENTS = 1 << 22  # GPUs: few, long kernels


class _Scratch:
    """The int64 buffers of one device's passes: widened words, their products, and the weights 2, 4, 6, ..."""

    def __init__(self, device: torch.device, elements: int) -> None:
        self.wide = torch.empty(elements, dtype=torch.int64, device=device)
        self.product = torch.empty_like(self.wide)
        self.weights = torch.arange(2, 2 * elements + 2, 2, dtype=torch.int64, device=device)


def _chunk_elements(device: torch.device) -> int:
    return CHUNK_ELEMENTS.get(device.type, DEFAULT_CHUNK_ELEMENTS)


def integer_view(tensor: Tensor) -> Tensor:
    """``tensor`` flattened and read as integers of the same width (a view: writes go to ``tensor``)."""
    flat = tensor.detach().view(-1)
    if flat.dtype.is_floating_point or flat.dtype.is_complex or flat.dtype == torch.bool:
        return flat.view(_INTEGER_OF_WIDTH[flat.element_size()])
    return flat


def bit_hash(tensor: Tensor, scratch: _Scratch | None = None) -> Tensor:
    """A 0-dim int64 on ``tensor``'s device that changes when any bit of ``tensor`` changes (see module)."""
    words = integer_view(tensor.contiguous())
    chunk = _chunk_elements(words.device)
    if scratch is None:
        scratch = _Scratch(words.device, min(words.numel(), chunk))
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), chunk):
        part = words[start : start + chunk]
        wide = scratch.wide[: part.numel()]
        wide.copy_(part)
        product = torch.mul(wide, scratch.weights[: part.numel()], out=scratch.product[: part.numel()])
        # Word i of the tensor weighs 2(i + 1) (even) plus the odd mix: a change of 2**bit in one word changes
        # the result by 2**bit x (odd), which never wraps around to 0 in int64 arithmetic, whatever the bit
        # and the position. A pass's weights restart at 2; the 2 x start they lack is added to its mix.
        total += wide.sum() * (_MIX + 2 * start) + product.sum()
    return total


def bit_hashes(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """The fingerprints of ``tensors``, one int64 each, as one vector on ``device`` (buffers shared by all)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    scratches: dict[torch.device, _Scratch] = {}
    for where in {tensor.device for tensor in tensors}:
        largest = max(tensor.numel() for tensor in tensors if tensor.device == where)
        scratches[where] = _Scratch(where, max(1, min(largest, _chunk_elements(where))))
    return torch.stack([bit_hash(tensor, scratches[tensor.device]).to(device) for tensor in tensors])
