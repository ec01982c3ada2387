"""The loss on vocabulary-split logits (the ``loss_parallel`` plan style), for an unmodified model.

With the LM head column-wise and its output left split (``loss_parallel`` in the plan), no rank ever holds the
whole logits (batch x sequence x vocabulary, the largest activation of a language model): torch's
``loss_parallel`` context computes the cross-entropy from each rank's slice of the vocabulary, with two small
all-reduces (the maximum and the sum of exponentials per token) instead of an all-gather of the logits.

torch asks two things of the training loop, which :func:`split_logits_loss` gives an unmodified model:

- the loss *and its backward* run inside the context. The strategy enters it around each step and around
  ``backward``;
- the loss comes back as a ``DTensor``, which Lightning's logging and loss bookkeeping do not take. Inside the
  context, a ``torch.overrides.TorchFunctionMode`` hands each ``cross_entropy`` / ``nll_loss`` result over as
  the plain tensor it holds, whole on every rank (``full_tensor``, differentiable). The model's
  ``self.log("train/loss", loss)`` and the returned loss are then what they are without TP.

The mode sees every torch function the step calls (about 20 a transformer layer, forward only): a few
microseconds each, paid only by plans that use ``loss_parallel``.

Example::

    with split_logits_loss():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # logits: DTensor, Shard(-1)
        loss.backward()  # loss: a plain tensor, the same value on every rank
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn import functional
from torch.overrides import TorchFunctionMode

LOSS_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset({functional.cross_entropy, functional.nll_loss})
"""The losses torch's ``loss_parallel`` computes on split logits (``nn.CrossEntropyLoss`` calls the first)."""


class _PlainLoss(TorchFunctionMode):
    """Returns a loss computed on split logits as a plain tensor, whole on every rank."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if func in LOSS_FUNCTIONS and isinstance(result, DTensor):
            return result.full_tensor()  # Replicate on the tensor-parallel mesh: no communication
        return result


@contextmanager
def split_logits_loss() -> Iterator[None]:
    """The ``loss_parallel`` context of torch, with the losses it computes returned as plain tensors."""
    with loss_parallel(), _PlainLoss():
        yield
