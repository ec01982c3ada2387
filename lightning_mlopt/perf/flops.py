"""FLOPs of a training step, counted by torch's FLOP counter, and the transformer formula they should match.

Example::

    with TrainingFlopCounter() as counter:
        loss = model(batch).sum()
        loss.backward()
    counter.total  # forward + backward FLOPs of that batch
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from lightning_mlopt._compat import (
    cpu_attention_ops,
    raw_flop_formula,
    undecomposed_flop_formulas,
    without_module_tracking,
)


def _cpu_sdpa_flops(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, key, value))


def _cpu_sdpa_backward_flops(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    return int(sdpa_backward_flop_count(grad_out, query, key, value))


# torch counts the CUDA attention kernels (flash, memory-efficient, cuDNN) but not the CPU one, which
# scaled_dot_product_attention uses on CPU: without these, a CPU run would miss every attention FLOP.
def _extra_formulas() -> dict[Any, Any]:
    forward, backward = cpu_attention_ops()
    return {forward: shape_wrapper(_cpu_sdpa_flops), backward: shape_wrapper(_cpu_sdpa_backward_flops)}


def _local(value: Any) -> Any:
    """``value`` with every DTensor in it (an op's arguments: tensors, lists, dicts) replaced by its local piece."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, list | tuple):
        return type(value)(_local(each) for each in value)
    if isinstance(value, dict):
        return {key: _local(each) for key, each in value.items()}
    return value


def _on_local_shapes(formula: Any) -> Any:
    """``formula`` (shape-wrapped) applied to what this rank computes: a DTensor's local piece, not its whole.

    torch's counter sees an op on DTensors at their global shapes, and the plain ops inside a tensor-parallel
    module (attention over this rank's heads) at their local ones: a mixture. Counted locally throughout, each
    rank's figure is the work it did, and the ranks' figures add up to the job's.
    """

    def counted(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return int(formula(*_local(args), out_val=_local(out_val), **_local(kwargs)))

    return raw_flop_formula(counted)  # given the tensors, not their shapes: it needs to see the DTensors


def _formulas() -> dict[Any, Any]:
    """The FLOP formulas of torch and of CPU attention, each on the local shapes (:func:`_on_local_shapes`).

    Every other op with a kernel of its own counts zero and runs that kernel, not its decomposition: counting
    changes no bit of the step it counts (``undecomposed_flop_formulas``).
    """
    counted = {op: _on_local_shapes(formula) for op, formula in {**flop_registry, **_extra_formulas()}.items()}
    return {**undecomposed_flop_formulas(), **counted}


class TrainingFlopCounter:
    """Counts the FLOPs of everything run inside it (forward and backward), with CPU attention included.

    torch's ``FlopCounterMode`` counts matmuls, convolutions and attention (full, without a causal discount,
    as the usual MFU formulas do); elementwise work, norms and embeddings lookups count zero. Every op runs the
    kernel it runs uncounted, so a counted step's results are bitwise those of an uncounted one. Its attention
    backward includes the recomputation of the scores that flash attention does (``2·B·T²·d`` per layer more
    than :func:`transformer_training_flops`, about 1% of a small GPT's total). Under activation
    checkpointing the recomputed forward is counted too (hardware FLOPs); give the model FLOPs by hand
    (``PerformanceMonitor(flops_per_sample=...)``) where that matters. Under tensor parallelism each op is
    counted at the shapes this rank computes (a DTensor's local piece): the rank's own work.

    Attributes:
        total: the FLOPs counted, once the block has exited.

    """

    def __init__(self) -> None:
        self.total = 0
        # The total only: torch's per-module tracking hooks every module's inputs, which pipeline stages reject.
        self._mode = without_module_tracking(FlopCounterMode(display=False, custom_mapping=_formulas()))
        # Compiled regions run eagerly while counted: dynamo meeting the counter's dispatch mode skips the
        # region's code for good (it then never compiles), and the eager ops are the model's FLOPs.
        self._eager = torch.compiler.set_stance("force_eager")

    def __enter__(self) -> TrainingFlopCounter:
        self._eager.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        try:
            self._mode.__exit__(kind, error, traceback)
        finally:
            self._eager.__exit__(kind, error, traceback)
        self.total = int(self._mode.get_total_flops())


def transformer_training_flops(
    n_layer: int, d_model: int, vocab_size: int, batch_size: int, seq_len: int, ffn_mult: int = 4
) -> int:
    """FLOPs of one forward and backward pass of a GPT-style decoder: ``6·N·tokens`` plus attention.

    ``N`` counts the matmul weights: per layer the QKV and output projections (``4·d²``) and the MLP
    (``2·ffn_mult·d²``), plus the LM head (``d·V``); embedding lookups cost no FLOPs. Attention adds
    ``4·B·T²·d`` per layer forward (scores and weighted sum) and twice that backward, counted over the full
    ``T x T`` square (no causal discount), as PaLM's and Megatron's MFU formulas do.

    Example::

        >>> transformer_training_flops(n_layer=2, d_model=128, vocab_size=256, batch_size=4, seq_len=64)
        704643072
    """
    params = n_layer * (4 + 2 * ffn_mult) * d_model**2 + d_model * vocab_size
    tokens = batch_size * seq_len
    attention = 12 * n_layer * batch_size * seq_len**2 * d_model
    return 6 * params * tokens + attention
