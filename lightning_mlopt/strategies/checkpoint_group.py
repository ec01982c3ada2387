"""The process group that background checkpoint writes coordinate over, apart from training's."""

from __future__ import annotations

from typing import Any

from lightning_mlopt._compat import strategy_timeout


class CheckpointGroupMixin:
    """Gives a strategy :attr:`checkpoint_process_group`: a gloo group created on first use.

    A background write coordinates ranks (DCP's plan exchange, our agreement before the commit) in a
    thread while training runs collectives; on one communicator the two would interleave unpredictably,
    and NCCL cannot carry DCP's CPU objects. torchtitan's async checkpointer does the same.

    Example::

        class FSDPStrategy(CheckpointGroupMixin, ModelParallelStrategy): ...
        dist.all_gather_object(out, mine, group=strategy.checkpoint_process_group)
    """

    _checkpoint_group: Any = None

    @property
    def checkpoint_process_group(self) -> Any:
        """The group; creating it is collective, so the first use must be on every rank, in the main thread."""
        if self._checkpoint_group is None:
            import torch.distributed as dist

            self._checkpoint_group = dist.new_group(backend="gloo", timeout=strategy_timeout(self))
        return self._checkpoint_group
