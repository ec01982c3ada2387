"""Route a model's ``scaled_dot_product_attention`` calls through the all-to-all: attention over the whole sequence.

Inside :class:`AllToAllAttention`, each call of ``torch.nn.functional.scaled_dot_product_attention`` on this rank's
slice of the sequence becomes: queries, keys and values exchanged for ``H / P`` heads over all ``S`` positions,
the same call there (``is_causal`` then means causal over the whole sequence), and the output exchanged back. Any
model that attends through that function is served unchanged; what it cannot honour is refused, never changed:
an explicit ``attn_mask`` (built by the model for its slice, not the sequence), heads or key/value heads that do
not divide by ``P``.

Example::

    with AllToAllAttention(group) as attention:
        loss = model(tokens_slice, positions_slice)
    attention.calls  # > 0: the model's attention went through the exchange
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.nn import functional
from torch.overrides import TorchFunctionMode

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies.context.all_to_all import heads_to_sequence, sequence_to_heads


class AllToAllAttention(TorchFunctionMode):
    """While active, ``scaled_dot_product_attention`` attends over the sequence all of ``group``'s ranks hold.

    Args:
        group: the context ranks' process group (rank ``r`` holds the ``r``-th slice of each sequence).

    Attributes:
        calls: attention calls routed so far.

    """

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.size = dist.get_world_size(group)
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, *rest = args
        if rest or kwargs.get("attn_mask") is not None:
            raise BadInputError(
                "context parallelism: the model passes scaled_dot_product_attention an attn_mask, built for its "
                "slice of the sequence, which the all-to-all cannot honour; use is_causal=True, or train without "
                "context_parallel_size"
            )
        for name, tensor in (("query", query), ("key/value", key)):
            if tensor.shape[1] % self.size:
                raise BadInputError(
                    f"context parallelism: the attention has {tensor.shape[1]} {name} heads, which "
                    f"context_parallel_size={self.size} does not divide; choose a divisor of it"
                )
        self.calls += 1
        query, key, value = (heads_to_sequence(tensor, self.group) for tensor in (query, key, value))
        return sequence_to_heads(func(query, key, value, **kwargs), self.group)


__all__ = ["AllToAllAttention"]
