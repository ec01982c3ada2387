"""A tensor-parallel plan from YAML: module-name globs to styles, resolved against the model and checked.

A plan maps globs over the LightningModule's module names to a style::

    tp_plan:
      model.layers.*.attn.qkv: colwise      # split the output features across the tensor-parallel ranks
      model.layers.*.attn.proj: rowwise     # split the input features; one all-reduce gives the full output
      model.lm_head: colwise_replicated     # split, then all-gather the logits

``*`` matches any part of a name, dots included, so ``*.q_proj`` finds every ``q_proj`` at any depth, and a
glob without ``*`` names one module. :func:`resolve` turns the globs into concrete module names and checks
them before any process group starts: every glob matches a module; each style fits its module (a Linear for
the linear styles, an Embedding for the embedding ones); the split dimension and any head count divide by the
tensor-parallel size; and a column-wise module's split output is consumed by a row-wise module in the same
scope. What no static check sees (a fused projection split in the wrong places, a ``view`` with a fixed head
count) the parity test catches against a one-process run.

Example::

    plan = resolve(module, {"model.layers.*.attn.qkv": "colwise", "model.layers.*.attn.proj": "rowwise"}, 2)
    parallelize_module(module, tp_mesh, plan.parallelize_plan())
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies.tensor.tp_heads import check_head_counts
from lightning_mlopt.strategies.tensor.tp_names import nearest_names


@dataclass(frozen=True)
class Style:
    """One plan style: which module it fits, which dimension it splits, and the torch style it becomes.

    Args:
        module_class: the class the module must be (or subclass).
        split_dimension: the module attribute that the tensor-parallel size must divide; None for a style that
            splits no parameter (sequence parallelism's norms, a module whose input is gathered).
        make: builds the ``torch.distributed.tensor.parallel`` style.
        splits_output: the module's output stays split across ranks (a row-wise module must consume it).
        description: one line for the docs and the error messages.
        consumes_split: the module takes a column-wise module's split output (the row-wise styles).
        splits_logits: the module's output stays split along its last dimension into the loss, which the
            strategy then computes inside torch's ``loss_parallel``
            (see :mod:`~lightning_mlopt.strategies.tensor.tp_loss`).

    """

    module_class: type[nn.Module]
    split_dimension: str | None
    make: Callable[[], ParallelStyle]
    splits_output: bool
    description: str
    consumes_split: bool = False
    splits_logits: bool = False


STYLES: dict[str, Style] = {
    "colwise": Style(
        nn.Linear,
        "out_features",
        ColwiseParallel,
        splits_output=True,
        description="output features split across ranks; a rowwise module in the same scope consumes them",
    ),
    "rowwise": Style(
        nn.Linear,
        "in_features",
        RowwiseParallel,
        splits_output=False,
        description="input features split (a colwise module's output); one all-reduce gives the full output",
        consumes_split=True,
    ),
    "colwise_replicated": Style(
        nn.Linear,
        "out_features",
        lambda: ColwiseParallel(output_layouts=Replicate()),
        splits_output=False,
        description="output features split, then all-gathered (e.g. an LM head whose loss needs all logits)",
    ),
    "embedding_rowwise": Style(
        nn.Embedding,
        "num_embeddings",
        lambda: RowwiseParallel(input_layouts=Replicate()),
        splits_output=False,
        description="the vocabulary split across ranks; one all-reduce gives every token's embedding",
    ),
    "embedding_colwise": Style(
        nn.Embedding,
        "embedding_dim",
        lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        splits_output=False,
        description="the embedding width split across ranks, then all-gathered",
    ),
    # Sequence parallelism (Korthikanti et al., 2022): between the split layers, the activations (and the
    # norms' and dropouts' work on them) are split along the sequence; the all-reduce of a row-wise layer
    # becomes a reduce-scatter, and the sequence is all-gathered where a block needs it whole.
    "sequence_parallel": Style(
        nn.Module,
        None,
        SequenceParallel,
        splits_output=False,
        description="a norm or dropout run on this rank's part of the sequence (its parameters replicated)",
    ),
    "gather_sequence": Style(
        nn.Module,
        None,
        lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        splits_output=False,
        description="the sequence-split input all-gathered whole before the module (an attention or MLP block)",
    ),
    "rowwise_sequence": Style(
        nn.Linear,
        "in_features",
        lambda: RowwiseParallel(output_layouts=Shard(1)),
        splits_output=False,
        description="rowwise, its partial outputs reduce-scattered along the sequence (sequence parallelism)",
        consumes_split=True,
    ),
    "embedding_rowwise_sequence": Style(
        nn.Embedding,
        "num_embeddings",
        lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-2)),
        splits_output=False,
        description="embedding_rowwise, its output reduce-scattered along the sequence (token or position ids)",
    ),
    "colwise_replicated_from_sequence": Style(
        nn.Linear,
        "out_features",
        lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        splits_output=False,
        description="colwise_replicated on a sequence-split input, all-gathered first (the LM head under SP)",
    ),
    # The LM head's logits stay split along the vocabulary into the loss (torch's loss_parallel): no rank
    # holds the whole logits, the largest activation of a language model.
    "loss_parallel": Style(
        nn.Linear,
        "out_features",
        lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        splits_output=False,
        description="an LM head whose logits stay split along the vocabulary; the cross-entropy is computed on "
        "the pieces (never gathered)",
        splits_logits=True,
    ),
    "loss_parallel_from_sequence": Style(
        nn.Linear,
        "out_features",
        lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        splits_output=False,
        description="loss_parallel on a sequence-split input, all-gathered first (the LM head under SP)",
        splits_logits=True,
    ),
}


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan whose globs are resolved to module names: ``{name: style}`` in the model's module order."""

    styles: dict[str, str]
    size: int
    widths: dict[str, int]  # each planned module's split dimension, unsplit

    def parallelize_plan(self) -> dict[str, ParallelStyle]:
        """The plan ``parallelize_module`` takes: each resolved module name and its torch style."""
        return {name: STYLES[style].make() for name, style in self.styles.items()}

    @contextmanager
    def split_on_fake_world(self, module: nn.Module) -> Iterator[None]:
        """``module`` split by the plan as rank 0 of a fake world of ``size`` ranks, with the plan's loss context.

        For counting one rank's bytes without starting processes (a meta-device model, see
        :func:`~lightning_mlopt.planning.probe.measure_activations`); ``module`` stays split afterwards.
        """
        from torch.distributed.tensor.parallel import parallelize_module

        from lightning_mlopt.planning.probe import fake_world
        from lightning_mlopt.strategies.tensor.tp_loss import split_logits_loss

        with fake_world(self.size) as mesh:
            parallelize_module(module, mesh, self.parallelize_plan())
            with split_logits_loss() if self.splits_logits else nullcontext():
                yield

    @property
    def splits_logits(self) -> bool:
        """Whether a module's output reaches the loss split (the loss then runs inside ``loss_parallel``)."""
        return any(STYLES[style].splits_logits for style in self.styles.values())

    def split_elements(self, module: nn.Module) -> int:
        """Elements of ``module``'s parameters that the plan splits (each rank holds ``1 / size`` of them).

        A split module's weight always; its bias where the output features are split (column-wise).
        """
        return sum(self.split_elements_by_module(module).values())

    def split_elements_by_module(self, module: nn.Module) -> dict[str, int]:
        """:meth:`split_elements` of each planned module, by name (0 for a style that splits no parameter)."""
        modules = dict(module.named_modules())
        counts = dict.fromkeys(self.styles, 0)
        for name, style in self.styles.items():
            if STYLES[style].split_dimension is None:
                continue  # its parameters (a norm's) are replicated
            for kind, param in modules[name].named_parameters(recurse=False):
                if kind == "weight" or STYLES[style].split_dimension in ("out_features", "embedding_dim"):
                    counts[name] += param.numel()
        return counts

    def describe(self) -> list[str]:
        """One line per planned module, e.g. ``model.layers.0.attn.qkv: colwise, out_features 384 -> 192 a rank``."""
        return [
            f"{name}: {style}, {STYLES[style].split_dimension} {self.widths[name]} -> "
            f"{self.widths[name] // self.size} a rank"
            if STYLES[style].split_dimension
            else f"{name}: {style} ({STYLES[style].description})"
            for name, style in self.styles.items()
        ]


def plan_of(module: nn.Module, plan: Mapping[str, str] | None, size: int) -> ResolvedPlan:
    """``plan``, or where it is None the model's own ``tp_plan`` attribute, resolved against ``module``.

    Raises:
        BadInputError: neither gives a plan, or the plan does not fit the model (:func:`resolve`).

    Example::

        >>> model = nn.Module()
        >>> model.fc, model.out = nn.Linear(8, 32), nn.Linear(32, 8)
        >>> model.tp_plan = {"fc": "colwise", "out": "rowwise"}
        >>> plan_of(model, None, 2).styles
        {'fc': 'colwise', 'out': 'rowwise'}

    """
    if plan is None:
        plan = getattr(module, "tp_plan", None)
        if not isinstance(plan, Mapping):
            raise BadInputError(
                f"tensor parallelism needs a plan: {type(module).__name__} declares no tp_plan and "
                "trainer.strategy.init_args.tp_plan is not set (see configs/strategies/tp.yaml)"
            )
    return resolve(module, plan, size)


def resolve(module: nn.Module, plan: Mapping[str, str], size: int) -> ResolvedPlan:
    """Resolve ``plan``'s globs against ``module`` and check that the plan fits it at tensor-parallel ``size``.

    Raises:
        BadInputError: an unknown style, a glob that matches nothing (the nearest globs that would match are
            given), a module claimed by two styles, a style on the wrong kind of module (GPT-2's ``Conv1D`` is
            not a Linear), a dimension or head count that ``size`` does not divide (the counts a module holds, its
            config's, or its projections' widths over ``head_dim``), or a column-wise output that nothing
            row-wise consumes.

    Example::

        >>> gpt = nn.ModuleDict({"fc": nn.Linear(8, 32), "out": nn.Linear(32, 8)})
        >>> resolve(gpt, {"fc": "colwise", "out": "rowwise"}, 2).styles
        {'fc': 'colwise', 'out': 'rowwise'}

    """
    if not plan:
        raise BadInputError("tp_plan is empty: give module-name globs and styles, e.g. configs/strategies/tp.yaml")
    modules = dict(module.named_modules())
    styles: dict[str, str] = {}
    claimed_by: dict[str, str] = {}
    for glob, style in plan.items():
        if style not in STYLES:
            raise BadInputError(f"tp_plan[{glob!r}]: unknown style {style!r}; choose one of {', '.join(STYLES)}")
        matched = [name for name in modules if name and fnmatchcase(name, glob)]
        if not matched:
            raise BadInputError(f"tp_plan: {glob!r} matches no module of the model.{nearest_names(glob, modules)}")
        for name in matched:
            if name in styles and styles[name] != style:
                raise BadInputError(
                    f"tp_plan: module {name} is {styles[name]} by {claimed_by[name]!r} and {style} by {glob!r}; "
                    "give each module one style"
                )
            styles[name], claimed_by[name] = style, glob
    ordered = {name: styles[name] for name in modules if name in styles}
    for name, style in ordered.items():
        _check_fit(name, modules[name], style, size)
    column_split = [name for name, style in ordered.items() if STYLES[style].split_dimension == "out_features"]
    check_head_counts(modules, column_split, size)
    _check_split_outputs_are_consumed(ordered)
    widths = {
        name: getattr(modules[name], dimension)
        for name, style in ordered.items()
        if (dimension := STYLES[style].split_dimension)
    }
    return ResolvedPlan(ordered, size, widths)


def _check_fit(name: str, module: nn.Module, style: str, size: int) -> None:
    spec = STYLES[style]
    if not isinstance(module, spec.module_class) and _is_conv1d(module):
        raise BadInputError(_conv1d_refusal(name, module, style))
    if not isinstance(module, spec.module_class):
        kind = spec.module_class.__name__
        raise BadInputError(
            f"tp_plan: {name} ({type(module).__name__}) cannot be {style}: that style splits an nn.{kind} "
            f"({spec.description})"
        )
    if spec.split_dimension is None:
        return
    width = getattr(module, spec.split_dimension)
    if width % size:
        raise BadInputError(
            f"tp_plan: {name} ({style}) splits {spec.split_dimension}={width}, which tensor_parallel_size={size} "
            "does not divide; choose a size that divides it, or leave the module out of the plan"
        )


def _is_conv1d(module: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2, GPT-J's ancestors), recognised without importing transformers.
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)


def _conv1d_refusal(name: str, module: nn.Module, style: str) -> str:
    inputs, outputs = getattr(module, "nx", "in"), module.nf
    fused = outputs == 3 * inputs if isinstance(inputs, int) else False
    return (
        f"tp_plan: {name} (Conv1D) cannot be {style}: it is transformers' Conv1D, a transposed Linear (weight "
        f"[in, out] = [{inputs}, {outputs}]), and tensor-parallel plans split an nn.Linear (weight [out, in])"
        + (
            ", and its output fuses q, k and v ([q | k | v]), which a column split cuts by position, not by head"
            if fused
            else ""
        )
        + "; train this model with ddp, fsdp or zero instead, or convert its Conv1D modules to nn.Linear (weights "
        "transposed)"
        + (" and split the fused projection into q, k and v ones" if fused else "")
        + " before planning them"
    )


def _check_split_outputs_are_consumed(styles: Mapping[str, str]) -> None:
    rowwise = [name for name, style in styles.items() if STYLES[style].consumes_split]
    for name, style in styles.items():
        if not STYLES[style].splits_output:
            continue
        scope = name.rpartition(".")[0]
        if not any(not scope or other.startswith(f"{scope}.") for other in rowwise):
            raise BadInputError(
                f"tp_plan: {name} is {style}, so its output stays split across ranks, and no rowwise module in "
                f"{scope or 'the model'} consumes it; plan the module that takes its output as rowwise, or make "
                f"{name} colwise_replicated"
            )
