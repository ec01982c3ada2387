"""Named values packed into one tensor for one collective, and read back by name.

Several small reductions in one step cost one all-reduce and one host read when packed; naming the slots
keeps the decoding from depending on the order and the conditions under which they were added.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Packed:
    """Slots of floats, added by name, concatenated for one collective, unpacked by name.

    Every rank must add the same names with the same sizes in the same order (they are summed slot by slot).

    Example::

        >>> packed = Packed()
        >>> packed.add("loss", torch.tensor(2.0))
        >>> packed.add("groups", torch.tensor([1.0, 3.0]))
        >>> vector = packed.tensor(torch.device("cpu"))  # dist.all_reduce(vector) here
        >>> values = packed.unpack(vector.tolist())
        >>> values["loss"], values["groups"]
        ([2.0], [1.0, 3.0])
    """

    def __init__(self) -> None:
        self._parts: list[tuple[str, Tensor]] = []

    def add(self, name: str, values: Tensor) -> None:
        """Add a slot: a 0-dim or 1-dim tensor (any float dtype, any device)."""
        if name in self:
            raise ValueError(f"slot {name!r} was added twice")
        self._parts.append((name, values.reshape(-1)))

    def __contains__(self, name: str) -> bool:
        return any(existing == name for existing, _ in self._parts)

    def tensor(self, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
        """All slots, in the order added, as one vector of ``dtype`` on ``device``.

        Slots elsewhere (a rank's GPU) move in one copy, not one per slot: each copy to the host is a wait.
        """
        if not self._parts:
            return torch.zeros(0, device=device, dtype=dtype)
        parts = [values for _, values in self._parts]
        away = [index for index, part in enumerate(parts) if part.device != device]
        if away:  # fp32 where they are (some devices have no float64), converted once here
            moved = torch.cat([parts[index].float() for index in away]).to(device)
            for index, part in zip(away, moved.split([parts[index].numel() for index in away]), strict=True):
                parts[index] = part
        return torch.cat([part.to(dtype) for part in parts])

    def unpack(self, flat: list[float]) -> dict[str, list[float]]:
        """Split ``flat`` (the vector, reduced and read on the host) back into the named slots."""
        result: dict[str, list[float]] = {}
        cursor = 0
        for name, values in self._parts:
            result[name] = flat[cursor : cursor + values.numel()]
            cursor += values.numel()
        if cursor != len(flat):
            raise ValueError(f"{len(flat)} values for {cursor} slots")
        return result
