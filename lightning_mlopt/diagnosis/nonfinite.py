"""Where a non-finite value was born: the first module, in forward order, whose output is not finite.

Run only on a bad step (healthy steps pay nothing): the step's forward pass is re-run without gradients,
with a forward hook on every module.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mlopt.diagnosis.module_names import module_group
from lightning_mlopt.distributed.sharding import Piece


@contextmanager
def watching_outputs(pl_module: Any) -> Iterator[tuple[list[int], list[str]]]:
    """Watch every submodule's output while the block runs, for the first that is not finite.

    ``first[0]`` becomes 1 + the index (in ``names``) of the first module, in forward order, whose floating
    output is not finite (0: none).

    Example::

        with watching_outputs(pl_module) as (first, names):
            pl_module.training_step(batch, batch_idx)
        culprit = names[first[0] - 1] if first[0] else None
    """
    modules = [(name, module) for name, module in pl_module.named_modules() if name]
    first = [0]

    def make_hook(index: int) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            tensor = output[0] if isinstance(output, (tuple, list)) and output else output
            floating = isinstance(tensor, Tensor) and tensor.is_floating_point()
            if first[0] == 0 and floating and not bool(torch.isfinite(tensor).all()):
                first[0] = index

        return hook

    handles = [module.register_forward_hook(make_hook(i + 1)) for i, (_, module) in enumerate(modules)]
    try:
        yield first, [name for name, _ in modules]
    finally:
        for handle in handles:
            handle.remove()


def nonfinite_gradient_modules(pieces: Sequence[Piece], names: dict[int, str], depth: int) -> list[str]:
    """The modules (cut to ``depth``) of the gradient pieces that hold a non-finite value, each once."""
    bad = []
    for piece in pieces:
        if piece.tensor.numel() and not bool(torch.isfinite(piece.tensor).all()):
            bad.append(module_group(names.get(id(piece.param), "?"), max(depth, 1)))
    return list(dict.fromkeys(bad))


def nonfinite_report(
    step: int, total: float, loss: float, culprits: dict[int, str], rank: int, bad_gradients: list[str]
) -> str:
    """The diagnosis: which ranks' forward passes went non-finite first where, or else the bad gradients.

    Example::

        >>> print(nonfinite_report(4, float("nan"), 2.5, {1: "layers.1.mlp.0"}, rank=0, bad_gradients=[]))
        non-finite values at step 4 (gradient norm nan, mean loss 2.5)
          rank 1: first non-finite output in forward order: layers.1.mlp.0
    """
    lines = [f"non-finite values at step {step} (gradient norm {total}, mean loss {loss})"]
    if culprits:
        for culprit_rank, module in sorted(culprits.items()):
            lines.append(f"  rank {culprit_rank}: first non-finite output in forward order: {module}")
    else:
        # Born in backward: the forward was finite everywhere. Name the modules whose gradients are not.
        lines.append(
            "  the forward pass was finite on every rank; modules with non-finite gradients on rank "
            f"{rank}: {', '.join(bad_gradients) or 'none here'}"
        )
    return "\n".join(lines)
