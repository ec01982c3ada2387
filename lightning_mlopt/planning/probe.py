"""Probing a model for the memory planner: its optimizer's kind and its activations, without using memory.

Example::

    with torch.device("meta"):
        model = instantiate({"class_path": "lightning_mlopt.demos.GPTLanguageModel"})
    optimizer_kind(model)   # 'adam'
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from lightning_mlopt.distributed.mesh_plan import MeshPlan


def instantiate(section: dict[str, Any]) -> Any:
    """The object a ``class_path``/``init_args`` section of a config describes (a model, a datamodule)."""
    module_name, _, name = section["class_path"].rpartition(".")
    return getattr(importlib.import_module(module_name), name)(**(section.get("init_args") or {}))


def optimizer_kind(model: Any) -> str:
    """What the planner needs of a model's optimizer: ``adam`` (two states), ``sgd_momentum`` (one) or ``sgd``."""
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    if isinstance(optimizer, (list, tuple)):
        optimizer = optimizer[0]
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    momentum = optimizer.defaults.get("momentum", 0) if hasattr(optimizer, "defaults") else 0
    return "sgd_momentum" if momentum else "sgd"


def measure_activations(model: Any, data: Any, around: AbstractContextManager[Any] | None = None) -> float:
    """Bytes of tensors the forward pass of one micro-batch saves for backward, on the meta device.

    ``around`` is entered for the forward, once the batch is there: e.g. one that splits the model by a
    tensor-parallel plan on a :func:`fake_world` (``ResolvedPlan.split_on_fake_world``). A saved ``DTensor``
    counts by its local piece, so the result is then one rank's bytes.

    No memory is used: the model is on the meta device and the batch is moved there; saved-tensor hooks
    add up what autograd keeps. Attention through ``F.scaled_dot_product_attention`` is counted as the fused
    kernels torch runs it with on GPUs and CPUs keep it (see :class:`_FusedAttention`), not as the meta
    device's reference path, which keeps every attention matrix: on an H200 that counted the GPT demo's
    activations 3.5x too high (``benchmarks/results/gpu_memory_h200_202611.md``). Tensors count at the dtype
    the model computes in (fp32 for the demos): under bf16 autocast the device holds less, so the estimate
    errs on the side of not fitting.

    Raises:
        MetaProbeError: ``training_step`` failed on meta tensors (e.g. a ``.item()`` on a value that depends on
            the data, as in ``transformers``' mask code). Errors of the data module itself are raised as they are.

    """
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    batch = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in batch]
    saved: dict[Any, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[id(tensor)] = _nbytes(tensor)
        return tensor

    silenced = model.log
    try:
        model.log = lambda *args, **kwargs: None  # no Trainer here: training_step's logging has nowhere to go
        with (
            around if around is not None else nullcontext(),
            _FusedAttention(saved),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        ):
            try:
                model.training_step(batch, 0)
            except Exception as error:  # the user's step on meta tensors: a failure means "not measured"
                raise MetaProbeError(error) from error
    finally:
        model.log = silenced
    return float(sum(saved.values()))


class MetaProbeError(RuntimeError):
    """The model's ``training_step`` does not run on the meta device, so its activations were not measured.

    Models that branch on a tensor's value do this: ``transformers``' mask code asks whether a batch holds packed
    sequences with ``.all()``, a ``.item()`` that a meta tensor, having no data, cannot answer. The message is one
    line naming the cause; the caller plans from parameters, gradients and optimizer state and says so.

    Args:
        cause: what ``training_step`` raised.

    Example::

        try:
            activations = measure_activations(model, data)
        except MetaProbeError as error:
            activations, note = 0.0, f"note: {error}"

    """

    def __init__(self, cause: BaseException) -> None:
        reason = next((line.strip() for line in str(cause).splitlines() if line.strip()), "no message")
        super().__init__(
            f"activations not measured: the model's training_step does not run on the meta device "
            f"({type(cause).__name__}: {reason[:200]})"
        )


@contextmanager
def fake_world(size: int) -> Iterator[DeviceMesh]:
    """A process group of ``size`` ranks in this process whose collectives return at once (torch's ``fake``).

    Enough for DTensor to give every tensor its local shape on the meta device; no process is started. The
    group is destroyed on the way out.

    Example::

        with fake_world(2) as mesh:
            parallelize_module(meta_model, mesh, plan)  # each parameter now holds rank 0's half
    """
    if dist.is_initialized():  # a tool's process has none; a training process has its real one
        raise RuntimeError("measuring a tensor-parallel rank's activations needs a process without a process group")
    dist.init_process_group("fake", rank=0, world_size=size, store=dist.HashStore())
    try:
        yield MeshPlan(tensor=size).build("cpu", keep=("tensor",))  # a tensor-parallel rank's view
    finally:
        dist.destroy_process_group()


def _nbytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # a rank holds its piece only
    return local.numel() * local.element_size()


class _FusedAttention(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` as a fused kernel keeps it for backward.

    Flash and memory-efficient attention (CUDA) and the flash kernel for CPU keep the query, key, value and
    output, and one fp32 log-sum-exp per query row; the meta device only has the reference path, which keeps
    the (batch, heads, length, length) attention weights as well. The output is computed without autograd and
    made a leaf that requires grad, so everything after it is recorded as before.
    """

    def __init__(self, saved: dict[Any, int]) -> None:
        super().__init__()
        self.saved = saved
        # Counted by id: the tensors are kept alive for the probe, so that no later tensor reuses an id.
        self._alive: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value = (
            kwargs[name] if name in kwargs else args[i] for i, name in enumerate(("query", "key", "value"))
        )
        with torch.no_grad():
            output = func(*args, **kwargs)
        for tensor in (query, key, value, output):
            self.saved[id(tensor)] = _nbytes(tensor)
            self._alive.append(tensor)
        rows = query.to_local() if isinstance(query, DTensor) else query
        self.saved[("logsumexp", id(output))] = rows.shape[:-1].numel() * 4
        return output.requires_grad_()
