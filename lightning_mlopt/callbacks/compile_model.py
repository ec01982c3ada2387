"""CompileModel: torch.compile from YAML, on the model's repeated blocks, in the strategy's order of steps.

torchtitan compiles each transformer block (regional compilation: one graph, reused by every block of the stack,
so compile time does not grow with depth) after tensor parallelism and activation checkpointing and before FSDP
wraps the blocks. Our strategies call this callback at exactly that point (``hooks.compile_model``); a strategy
that does not (Lightning's own, DeepSpeed) leaves it to compile at the start of fit, after its wrapping.

Each region is compiled in place (``nn.Module.compile``), so parameter names stay the eager ones (no
``_orig_mod.``): a checkpoint saved with compile on resumes with it off, and the other way round. What compiling
cost is said after the first training step that compiled (PerformanceMonitor's FLOP-counted first step runs
eagerly) and kept in ``perf/summary.json`` (``perf/compile_watch.py``); a run whose later training steps recompiled
(each such step stalls) is told so at its end. Validation compiles the eval-mode variant of each graph once, outside
training steps: expected, not counted there.

Example::

    trainer = Trainer(strategy=FSDPStrategy(...), callbacks=[CompileModel()])   # the blocks, with inductor

    # YAML: add configs/features/compile.yaml to any strategy overlay
    #   python -m lightning_mlopt fit --config configs/gpt.yaml --config configs/strategies/fsdp.yaml
    #       --config configs/features/compile.yaml
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.hooks import CompilesModel, RunsPipeline
from lightning_mlopt.perf.compile_watch import CompileRecord, CompilingBatches, compile_watch
from lightning_mlopt.strategies.fsdp_units import import_module_class, is_container, require_classes, root_units

Regions = Literal["blocks", "model"]


class CompileModel(CompilesModel, pl.Callback):
    """Compile the model's repeated blocks (or the whole network) with torch.compile, configured from YAML.

    Args:
        enabled: compile; False leaves the model eager (the CLI's default: ``configs/features/compile.yaml``
            turns it on).
        regions: ``blocks`` (default): each repeated block, found as the members of the model's block stacks
            (a ``ModuleList``/``ModuleDict`` of one class: nanoGPT's ``layers``, a Hugging Face model's
            ``model.layers``), or the classes ``block_classes`` names. ``model``: each of the LightningModule's
            child networks whole (under FSDP the units' hooks still break its graph at each unit).
        block_classes: import paths of the block classes to compile (as ``wrap_classes``); empty: found.
        backend: torch.compile's backend (``inductor``; ``aot_eager`` compiles without generating kernels).
        mode: torch.compile's mode (``default``, ``reduce-overhead``, ``max-autotune``, ...); None: default.
        fullgraph: fail on a graph break instead of running its code eagerly.
        dynamic: compile for dynamic shapes (True), static ones (False), or let torch decide (None).

    Raises:
        ValueError: a ``block_classes`` path is not a module class.
        BadInputError (at set-up): no block found, a named class is not in the model, or pipeline parallelism.

    Example::

        trainer = Trainer(callbacks=[CompileModel(backend="inductor", mode="max-autotune")])

    """

    def __init__(
        self,
        enabled: bool = True,
        regions: Regions = "blocks",
        block_classes: Sequence[str] = (),
        backend: str = "inductor",
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
    ) -> None:
        if regions not in ("blocks", "model"):
            raise ValueError(f"regions must be 'blocks' or 'model', got {regions!r}")
        self.enabled = enabled
        self.regions = regions
        self.block_classes = [import_module_class(path, "block_classes") for path in block_classes]
        self.backend = backend
        self.mode = mode
        self.fullgraph = fullgraph
        self.dynamic = dynamic
        self.compiled: list[str] = []  # the regions' names, once compiled
        self.training_recompilations = 0  # in training steps after the first that compiled: each stalled
        self.first_training_recompile: int | None = None  # the step
        self._batch = CompilingBatches()  # what each training batch compiled
        self._reported = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.compiled, self._reported = [], False  # once per fit: a second fit may bring another module
        self.training_recompilations, self.first_training_recompile = 0, None
        if self.enabled and getattr(trainer.strategy, "context_parallel_size", 1) > 1:
            raise BadInputError(
                "compile: context parallelism routes attention through a function mode that compiled regions do "
                "not see yet; remove configs/features/compile.yaml (compile.enabled: false) or context_parallel_size"
            )
        if self.enabled and isinstance(trainer.strategy, RunsPipeline):
            raise BadInputError(
                "compile: pipeline parallelism runs traced stage graphs that torch.compile does not reach yet; "
                "remove configs/features/compile.yaml (compile.enabled: false) or choose another strategy"
            )

    @override
    def compile_model(self, trainer: pl.Trainer, module: Any) -> None:
        """Compile the regions of ``module`` in place (once; the strategy calls it before wrapping the model)."""
        if not self.enabled or self.compiled:
            return
        compile_watch()  # counting starts before the first compiled call
        for name, region in self.regions_of(module):
            region.compile(backend=self.backend, mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic)
            self.compiled.append(name)

    def regions_of(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """The ``(name, module)`` pairs this callback compiles in ``module``.

        Raises:
            BadInputError: no repeated block, or a ``block_classes`` class the model lacks.

        """
        named = list(module.named_modules())
        if self.regions == "model":
            units = {id(unit) for unit in root_units(module)}
            return [(name, sub) for name, sub in named if id(sub) in units and any(True for _ in sub.parameters())]
        if self.block_classes:
            require_classes(module, self.block_classes, "compile.block_classes")
            return _outermost([pair for pair in named if isinstance(pair[1], tuple(self.block_classes))])
        blocks = repeated_blocks(module)
        if not blocks:
            raise BadInputError(
                "compile: found no repeated blocks (a ModuleList or ModuleDict of one class) in the model; name "
                "them in compile.block_classes, or set compile.regions: model"
            )
        return blocks

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled and not self.compiled:  # a strategy that has no compile step: after its wrapping
            self.compile_model(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.compiled:
            self._batch.started()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.compiled:
            return
        batch = self._batch.in_batch()
        if not self._reported:
            # The first training step that compiled (PerformanceMonitor's FLOP-counted first step runs eagerly;
            # validation's eval-mode graphs compile outside training steps).
            if batch.compilations:
                self._reported = True
                rank_zero_info(self.describe(trainer.global_step, batch, compile_watch().record()))
            return
        if batch.recompilations and not self.training_recompilations:  # a later step recompiled: it stalled
            self.first_training_recompile = trainer.global_step
        self.training_recompilations += batch.recompilations

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.compiled and not self._reported:
            rank_zero_warn(
                f"torch.compile compiled no graph in {trainer.global_step} training step(s): the regions ran eagerly "
                "(something disabled dynamo: TORCHDYNAMO_DISABLE, a torch.compiler stance, a tracer)"
            )
        if self.training_recompilations:
            rank_zero_warn(
                f"torch.compile recompiled {self.training_recompilations} time(s) in training steps after its first "
                f"(first at step {self.first_training_recompile}); each recompilation stalls its step. Run with "
                "TORCH_LOGS=recompiles to see which guard failed (often a changing shape: drop_last=True, or "
                "compile.dynamic: true)"
            )

    def describe(self, step: int, batch: CompileRecord, record: CompileRecord) -> str:
        """The line after the first training step that compiled: what, with what, and what that step (``batch``) paid.

        Example::

            torch.compile (inductor): 2 block region(s) (model.layers.0, ...); step 2 compiled 2 graph(s) in
            14.2 s (14.9 s in all so far, 1 recompilation(s))
        """
        options = [f"mode {self.mode}"] * bool(self.mode) + ["fullgraph"] * self.fullgraph
        first = self.compiled[0] + (", ..." if len(self.compiled) > 1 else "")
        kind = "block" if self.regions == "blocks" else "network"
        return (
            f"torch.compile ({', '.join([self.backend, *options])}): {len(self.compiled)} {kind} region(s) ({first}); "
            f"step {step} compiled {batch.compilations} graph(s) in {batch.seconds:.1f} s "
            f"({record.seconds:.1f} s in all so far, {record.recompilations} recompilation(s))"
        )


def repeated_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The members of every block stack in ``module``: a ``ModuleList``/``ModuleDict`` of 2+ members of one class.

    A stack inside a found block (a mixture of experts' ``experts`` list) is part of that block's region.

    Example::

        [name for name, _ in repeated_blocks(gpt)]   # ['model.layers.0', 'model.layers.1']
    """
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if not is_container(sub) or any(name.startswith(f"{block}.") for block, _ in found):
            continue
        members = [(f"{name}.{child}" if name else child, member) for child, member in sub.named_children()]
        one_class = len({type(member) for _, member in members}) == 1
        if len(members) >= 2 and one_class and any(True for _ in sub.parameters()):
            found.extend(members)
    return found


def _outermost(chosen: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop the regions inside another region (compiling the outer one covers them)."""
    kept: list[tuple[str, nn.Module]] = []
    for name, sub in chosen:
        if not any(name.startswith(f"{outer}.") for outer, _ in kept):
            kept.append((name, sub))
    return kept


__all__ = ["CompileModel", "repeated_blocks"]
