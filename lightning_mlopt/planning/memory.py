"""Bytes per rank for each strategy, in the ZeRO paper's accounting, and the simplest strategy that fits.

Accounting (Rajbhandari et al., 2020): with ``Ψ`` parameters on ``N`` data-parallel ranks, each rank holds
parameters ``P·Ψ``, gradients ``G·Ψ`` and optimizer state ``K·Ψ`` bytes, where for mixed precision
``P = G = 2`` (fp16/bf16) and ``K = 4`` (fp32 master weights) ``+ 4 x`` (optimizer states: Adam 2, SGD with
momentum 1, SGD 0); in fp32 ``P = G = 4`` and there is no master copy. Then:

    DDP     (P + G + K) Ψ            ZeRO-2   P Ψ + (G + K) Ψ / N
    ZeRO-1  (P + G) Ψ + K Ψ / N       ZeRO-3 / FSDP full shard   (P + G + K) Ψ / N

In fp32, DeepSpeed's ZeRO-1/2 (and the ZeRO-3 offload row, run with DeepSpeed) still keep an fp32 master
copy of their partition, so their K is 4 higher; the ZeRO-3 row is run with FSDP, which keeps none.
CPU-offload variants keep the offloaded part in host memory (reported separately). Activations come on top:
measured from one micro-batch when a config is given, else what ``activation_bytes`` says.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from lightning_mlopt.distributed.mesh_plan import MeshPlan

Precision = Literal["mixed", "fp32"]
OptimizerKind = Literal["adam", "sgd_momentum", "sgd"]

_STATES = {"adam": 2, "sgd_momentum": 1, "sgd": 0}
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """Bytes in a size such as ``80GB``, ``80GiB``, ``512MB`` (decimal and binary units).

    Raises:
        ValueError: not a number with a known unit, or not positive.

    Example::

        >>> parse_size("80GB"), parse_size("1.5GiB")
        (80000000000, 1610612736)

    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match:
        raise ValueError(f"not a size: {text!r}; write a number and a unit, e.g. 80GB or 80GiB")
    number, unit = float(match.group(1)), match.group(2).upper()
    if unit not in _UNITS:
        raise ValueError(
            f"unknown unit {match.group(2)!r} in {text!r}; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    if number <= 0:
        raise ValueError(f"a size must be > 0, got {text!r}")
    return int(number * _UNITS[unit])


def parse_count(text: str) -> int:
    """A parameter count such as ``7.5B``, ``350M``, ``1.3e9`` or ``125000000``.

    Example::

        >>> parse_count("7.5B")
        7500000000
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]?)\s*", str(text))
    if not match or match.group(2).upper() not in _SUFFIXES:
        raise ValueError(f"not a parameter count: {text!r}; e.g. 7.5B, 350M or 125000000")
    count = int(float(match.group(1)) * _SUFFIXES[match.group(2).upper()])
    if count <= 0:
        raise ValueError(f"the parameter count must be > 0, got {text!r}")
    return count


@dataclass(frozen=True)
class PlanRow:
    """Per-rank bytes of one strategy and whether it fits."""

    strategy: str
    parameters: float
    gradients: float
    optimizer_state: float
    activations: float
    cpu_offloaded: float
    total: float
    fits: bool


@dataclass(frozen=True)
class MemoryPlan:
    """The table, the recommendation and the inputs it was computed from."""

    num_params: int
    world_size: int
    gpu_memory: int
    headroom: float
    precision: Precision
    optimizer: OptimizerKind
    rows: list[PlanRow]
    recommendation: str | None

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (``--format json``)."""
        return asdict(self)


def bytes_per_parameter(precision: Precision, optimizer: OptimizerKind) -> tuple[int, int, int]:
    """(P, G, K) bytes per parameter.

    Example::

        >>> bytes_per_parameter("mixed", "adam")  # the ZeRO paper's 2 + 2 + 12
        (2, 2, 12)
    """
    states = 4 * _STATES[optimizer]
    if precision == "mixed":
        return 2, 2, 4 + states
    return 4, 4, states


def plan_memory(
    num_params: int,
    world_size: int,
    gpu_memory: int,
    precision: Precision = "mixed",
    optimizer: OptimizerKind = "adam",
    activation_bytes: float = 0.0,
    headroom: float = 0.1,
    tensor_parallel: tuple[int, int] | None = None,
    tensor_parallel_activation_bytes: float | None = None,
    pipeline: PipelineShare | None = None,
    replicate: int = 1,
    context: int = 1,
) -> MemoryPlan:
    """Rows for DDP, ZeRO-1, ZeRO-2, HSDP, ZeRO-3/FSDP and their CPU-offload variants; the first that fits wins.

    The HSDP row (``hsdpRxS``) is there when ``replicate`` > 1 (``strategy: auto`` on several nodes: R = the
    node count): FSDP's state divided by the S = world / R ranks of one replica, not by the world. It comes after
    ZeRO-2 and before full sharding: where it fits, a step's all-gathers stay within a node.

    A strategy fits when ``total x (1 + headroom) <= gpu_memory``. With ``tensor_parallel`` = (T, S), a plan
    splitting S of the parameters T ways, a last row: tensor parallelism (``tpT``), or FSDP x TP
    (``fsdpDxtpT``) when the world holds D = world / T data-parallel groups; it is a row to compare, never the
    recommendation (``strategy: auto`` does not choose TP: it needs a plan). Its activations are
    ``tensor_parallel_activation_bytes`` (one rank's under the plan, see
    :func:`~lightning_mlopt.planning.probe.measure_activations`), else ``activation_bytes``. With ``pipeline``,
    a row for pipeline parallelism (``ppP``, ``ppPxfsdpD``, and with tensor parallelism ``ppPxtpT`` or
    ``ppPxfsdpDxtpT``) from the busiest pipeline rank's share. With ``context`` = C > 1, a row for context
    parallelism (``cpC``, ``fsdpDxcpC``): FSDP's state over the whole world, a C-th of the activations (each rank
    holds a C-th of every sequence; attention, after the exchange, a C-th of the heads).

    Raises:
        ValueError: a non-positive count, world size or memory, or a headroom outside [0, 1).

    Example::

        >>> plan = plan_memory(7_500_000_000, 64, 80 * 10**9)
        >>> [round(row.total / 1e9, 1) for row in plan.rows[:4]]
        [120.0, 31.4, 16.6, 1.9]

    """
    if num_params < 1:
        raise ValueError(f"num_params must be >= 1, got {num_params}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if gpu_memory <= 0:
        raise ValueError(f"gpu_memory must be > 0, got {gpu_memory}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    from lightning_mlopt.distributed.mesh_plan import MeshPlan  # here: this module's arithmetic imports no torch

    hsdp = MeshPlan.fill(world_size, replicate=replicate, keys={"replicate": "replicate_size"})  # BadInputError
    p, g, k = bytes_per_parameter(precision, optimizer)
    # DeepSpeed's ZeRO optimizers keep an fp32 copy of their partition even when training in fp32 (measured:
    # benchmarks/results/strategies_*); FSDP, which `strategy: auto` runs for the ZeRO-3 row, does not.
    k_ds = k + 4 if precision == "fp32" else k
    psi, n = float(num_params), float(world_size)
    layouts = [
        # name, parameters, gradients, optimizer state on the GPU, offloaded to CPU memory
        ("ddp", p * psi, g * psi, k * psi, 0.0),
        ("zero1", p * psi, g * psi, k_ds * psi / n, 0.0),
        ("zero2", p * psi, g * psi / n, k_ds * psi / n, 0.0),
        *_hsdp_layouts(hsdp, psi, (p, g, k)),
        ("zero3/fsdp", p * psi / n, g * psi / n, k * psi / n, 0.0),
        ("zero1+offload", p * psi, g * psi, 0.0, k_ds * psi / n),
        ("zero2+offload", p * psi, g * psi / n, 0.0, k_ds * psi / n),
        ("zero3/fsdp+offload", 0.0, g * psi / n, 0.0, (p + k_ds) * psi / n),
    ]
    rows = []
    for name, params, grads, optim, offloaded in layouts:
        total = params + grads + optim + activation_bytes
        rows.append(
            PlanRow(
                name, params, grads, optim, activation_bytes, offloaded, total, total * (1 + headroom) <= gpu_memory
            )
        )
    recommendation = next((row.strategy for row in rows if row.fits), None)
    if tensor_parallel is not None:
        split_activations = tensor_parallel_activation_bytes
        if split_activations is None:
            split_activations = activation_bytes
        row = _tensor_parallel_row(tensor_parallel, psi, world_size, (p, g, k), split_activations)
        rows.append(replace(row, fits=row.total * (1 + headroom) <= gpu_memory))
    if pipeline is not None:
        row = _pipeline_row(pipeline, world_size, (p, g, k), activation_bytes)
        rows.append(replace(row, fits=row.total * (1 + headroom) <= gpu_memory))
    if context > 1:
        plan = MeshPlan.fill(world_size, context=context, keys={"context": "context_parallel_size"})
        name = f"fsdp{plan.shard}xcp{context}" if plan.shard > 1 else f"cp{context}"
        state, share = (p * psi / n, g * psi / n, k * psi / n), activation_bytes / context
        total = sum(state) + share
        rows.append(PlanRow(name, *state, share, 0.0, total, total * (1 + headroom) <= gpu_memory))
    return MemoryPlan(num_params, world_size, gpu_memory, headroom, precision, optimizer, rows, recommendation)


def _hsdp_layouts(
    plan: MeshPlan, psi: float, per_parameter: tuple[int, int, int]
) -> list[tuple[str, float, float, float, float]]:
    """HSDP's layout (none for one replica, or one shard: that is FSDP, or DDP): the state over one replica's ranks."""
    if plan.replicate == 1 or plan.shard == 1:
        return []
    p, g, k = per_parameter
    shard = plan.shard
    return [(f"hsdp{plan.replicate}x{shard}", p * psi / shard, g * psi / shard, k * psi / shard, 0.0)]


def _tensor_parallel_row(
    tensor_parallel: tuple[int, int],
    psi: float,
    world_size: int,
    per_parameter: tuple[int, int, int],
    activation_bytes: float,
) -> PlanRow:
    """Each rank holds 1/T of the split parameters and all of the rest, then FSDP divides that by D."""
    size, split = tensor_parallel
    if size < 1 or world_size % size:
        raise ValueError(f"tensor_parallel_size ({size}) must divide the world size ({world_size})")
    data = world_size // size
    held = (split / size + (psi - split)) / data
    p, g, k = per_parameter
    name = f"tp{size}" if data == 1 else f"fsdp{data}xtp{size}"
    total = (p + g + k) * held + activation_bytes
    return PlanRow(name, p * held, g * held, k * held, activation_bytes, 0.0, total, fits=False)  # judged by the caller


@dataclass(frozen=True)
class PipelineShare:
    """What the busiest pipeline rank holds: the largest sum of its stages' parameters, and its activations.

    ``in_flight``: micro-batches whose activations that rank keeps at once (the schedule's: all ``m`` under
    GPipe, at most the number of pipeline ranks under 1F1B); ``activation_share``: that rank's share of the
    model's activations per micro-batch (its parameter share, as an estimate). Under pipeline x tensor
    parallelism, ``largest_rank_split`` of that rank's parameters are split ``tensor`` ways (its activations are
    counted whole: the norms' and the residual stream's are not split).
    """

    size: int
    largest_rank_params: int
    microbatches: int
    in_flight: int
    activation_share: float
    tensor: int = 1
    largest_rank_split: int = 0


def _pipeline_row(
    share: PipelineShare, world_size: int, per_parameter: tuple[int, int, int], activation_bytes: float
) -> PlanRow:
    """The busiest pipeline rank's state, split by TP and divided by FSDP over the data ranks; its activations."""
    if share.size < 1 or share.tensor < 1 or world_size % (share.size * share.tensor):
        sizes = f"pipeline_parallel_size ({share.size})" + (f" x tensor ({share.tensor})" if share.tensor > 1 else "")
        raise ValueError(f"{sizes} must divide the world size ({world_size})")
    data = world_size // (share.size * share.tensor)
    split = share.largest_rank_split
    held = (share.largest_rank_params - split + split / share.tensor) / data
    activations = activation_bytes / share.microbatches * share.in_flight * share.activation_share
    p, g, k = per_parameter
    name = f"pp{share.size}" + (f"xfsdp{data}" if data > 1 else "") + (f"xtp{share.tensor}" if share.tensor > 1 else "")
    total = (p + g + k) * held + activations
    return PlanRow(name, p * held, g * held, k * held, activations, 0.0, total, fits=False)  # judged by the caller


def format_table(plan: MemoryPlan) -> str:
    """The plan as a text table (GB, or MB for small models) with its accounting in a footer."""
    gb, unit = (1e9, "GB") if max(row.total for row in plan.rows) >= 1e9 else (1e6, "MB")
    lines = [
        f"{plan.num_params / 1e9:.3g}B parameters, {plan.world_size} ranks, {plan.gpu_memory / 1e9:.3g} GB per GPU, "
        f"{plan.precision} precision, {plan.optimizer}, headroom {plan.headroom:.0%}",
        f"{'strategy':20} {'params':>9} {'grads':>9} {'optim':>9} {'activ':>9} {'total':>9} {'cpu':>9}  fits",
    ]
    for row in plan.rows:
        lines.append(
            f"{row.strategy:20} {row.parameters / gb:9.2f} {row.gradients / gb:9.2f} {row.optimizer_state / gb:9.2f} "
            f"{row.activations / gb:9.2f} {row.total / gb:9.2f} {row.cpu_offloaded / gb:9.2f}  "
            f"{'yes' if row.fits else 'no'}"
        )
    p, g, k = bytes_per_parameter(plan.precision, plan.optimizer)
    lines += [
        f"recommendation: {plan.recommendation or 'nothing fits: more GPUs, more memory, or a smaller model'}",
        f"accounting: {unit} per rank (1e{9 if unit == 'GB' else 6} bytes); bytes/parameter P={p}, G={g}, K={k} "
        "(ZeRO paper, Rajbhandari et al. 2020); sharded parts divided by the world size; in fp32 DeepSpeed's "
        "rows add its fp32 master partition (K + 4); 'cpu' is host memory per rank under offload; fits = "
        "total x (1 + headroom) <= GPU memory.",
    ]
    return "\n".join(lines)
