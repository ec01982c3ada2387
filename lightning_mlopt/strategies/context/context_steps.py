"""What context parallelism adds to a strategy's steps: the batch cut per rank, attention through the all-to-all.

:class:`ContextParallelSteps` is mixed into FSDPStrategy (``context_parallel_size``); at size 1 every method passes
straight through. FSDP shards over the shard and context ranks together and averages their gradients; each rank's
loss is the mean over its slice, weighted by its share of the labelled tokens (``token_weight``: 1 with no
ignored labels), so the average is the per-token mean over the whole sequence, the one-process loss.

Example::

    strategy = FSDPStrategy(context_parallel_size=2, position_key=2)   # (tokens, targets, positions) batches
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn

from lightning_mlopt.distributed.mesh_plan import MeshPlan
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies.context.sdpa_mode import AllToAllAttention
from lightning_mlopt.strategies.context.sequence_split import split_sequences, token_weight
from lightning_mlopt.strategies.fsdp_options import FSDPOptions

CONTEXT = "context"  # the mesh dimension


class ContextParallelSteps:
    """Cut each batch's sequences to this rank's slice; run each step's attention through the all-to-all.

    The host strategy sets ``context_parallel_size`` and ``position_key`` and has a ``device_mesh`` with a
    ``context`` dimension when the size is over 1.
    """

    context_parallel_size: int
    position_key: str | int
    device_mesh: Any
    _token_weight = 1.0  # this rank's share of the batch's labelled tokens, set with each batch (token_weight)

    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        """Lightning's move to the device, then this rank's slice of every sequence tensor."""
        if self.context_parallel_size == 1:
            return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]
        rank = self.device_mesh[CONTEXT].get_local_rank()
        # Counted over every slice, before the cut, and before the move: where the loader left it (on the host, no
        # device synchronisation in the step).
        self._token_weight = token_weight(batch, rank, self.context_parallel_size)
        batch = super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]
        return split_sequences(batch, rank, self.context_parallel_size, self.position_key)

    @contextmanager
    def _whole_sequence_attention(self) -> Iterator[AllToAllAttention | None]:
        if self.context_parallel_size == 1:
            yield None
            return
        with AllToAllAttention(self.device_mesh[CONTEXT].get_group()) as attention:
            yield attention

    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The step with attention over the whole sequence; refused when no attention went through the exchange."""
        with self._whole_sequence_attention() as attention:
            output = super().training_step(*args, **kwargs)  # type: ignore[misc]
        if attention is not None and attention.calls == 0:
            # Every rank runs the same model: all refuse together, none waits in a collective.
            raise BadInputError(
                "context parallelism: the model made no torch.nn.functional.scaled_dot_product_attention call, so "
                "its attention saw this rank's slice of the sequence alone; attend through that function, or "
                "train without context_parallel_size"
            )
        return self._weighted(output)

    def _weighted(self, output: Any) -> Any:
        """The step's loss times this rank's token weight (1 unless labels ignore tokens unevenly across slices)."""
        weight = self._token_weight
        if weight == 1.0:
            return output
        if isinstance(output, Mapping) and "loss" in output:
            return {**output, "loss": output["loss"] * weight}
        if isinstance(output, Tensor):
            return output * weight
        # Manual optimisation (the step ran its own backward) or no loss: the weight cannot be applied.
        raise BadInputError(
            "context parallelism: labels ignore tokens unevenly across the slices and the training step returned "
            "no loss to weigh (manual optimisation?); return the loss, or batch sequences without ignored labels"
        )

    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The step with attention over the whole sequence."""
        with self._whole_sequence_attention():
            return super().validation_step(*args, **kwargs)  # type: ignore[misc]

    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The step with attention over the whole sequence."""
        with self._whole_sequence_attention():
            return super().test_step(*args, **kwargs)  # type: ignore[misc]

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, or refused under context parallelism (outputs would come out split)."""
        if self.context_parallel_size > 1:
            raise BadInputError("predict under context parallelism is not offered yet: predict with fsdp or ddp")
        return super().predict_step(*args, **kwargs)  # type: ignore[misc]


def refuse_with_context(plan: MeshPlan, options: FSDPOptions, module: nn.Module | None = None) -> None:
    """BadInputError for what context parallelism does not combine with yet, or cannot serve exactly (before launch).

    Tensor parallelism wants the context dimension folded into its plan, and activation checkpointing would
    recompute attention in backward outside the all-to-all: each is refused rather than run.
    A model whose configuration declares attention other than full causal (a sliding window, chunks) is refused:
    its slice's mask would be lost in the exchange, and Hugging Face builds none when a slice is shorter than
    the window.
    """
    why = attention_refusal(module, plan.context) if module is not None else None
    if why:
        raise BadInputError(
            f"context parallelism: the model declares {why}, which the all-to-all cannot honour (it attends with "
            "full causal attention over the sequence); train it without context_parallel_size"
        )
    combined = {
        "tensor_parallel_size": plan.tensor > 1,
        "activation_checkpointing": bool(options.activation_checkpointing),
        "pipeline_parallel_size": plan.pipeline > 1,
    }
    refused = [key for key, given in combined.items() if given]
    if refused:
        raise BadInputError(
            f"context_parallel_size={plan.context} with {refused[0]}: not offered yet (FSDP and HSDP x context "
            "parallelism are); remove one of them"
        )


def attention_refusal(module: nn.Module, size: int = 1) -> str | None:
    """What in ``module``'s configurations (Hugging Face's ``config``) the exchange over ``size`` ranks cannot serve.

    None if nothing. Head counts are checked here, before launch, where the config states them (the attention
    calls check them again, for any model).

    Example::

        attention_refusal(qwen2_with_sliding_window)  # "sliding-window attention (sliding_window=32)"
    """
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is None:
            continue
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, key, None)
            if isinstance(heads, int) and heads % size:
                return f"{key}={heads}, which context_parallel_size={size} does not divide (heads are exchanged)"
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            return f"sliding-window attention (sliding_window={config.sliding_window})"
        kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention"}
        if kinds:
            return f"layers of attention kind {', '.join(sorted(kinds))}"
        if getattr(config, "attention_chunk_size", None):
            return f"chunked attention (attention_chunk_size={config.attention_chunk_size})"
    return None


__all__ = ["CONTEXT", "ContextParallelSteps", "attention_refusal", "refuse_with_context"]
