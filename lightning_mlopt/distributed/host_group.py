"""The process group for small sums on the host: training's own where it runs on gloo, else a gloo group.

A per-step vote or a monitor's window is a handful of host numbers. Summed over NCCL they would queue behind
the step's kernels and their result would make the host wait for the device; over gloo they stay on the host.
Where training itself runs on gloo (CPU), its group serves: no second set of gloo threads competes for the
cores.

Example::

    group = host_sum_group()           # on every rank, at the same point (making a group is collective)
    dist.all_reduce(values, group=group)
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def host_sum_group() -> Any:
    """None (training's own group) where training runs on gloo, else a new gloo group; collective off gloo."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
