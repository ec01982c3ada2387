"""Is a parallel configuration silently wrong? What a run records for the comparison, and the comparison.

The ``parity`` tool (``tools/parity.py``) runs a few steps of a configuration and of a one-process reference
of the same model, seed and data, each with :class:`ParityRecorder`, then compares them with
:func:`compare`: the losses step by step, the first step's gradients and the final parameters tensor by
tensor, every tensor whole (DTensor shards gathered, ZeRO-3 partitions too). Under DeepSpeed the gradients are
not recorded (its engine owns them, in its own partitions); the verdict then says they were not compared.

Example::

    verdict = compare(load_record(parallel_folder), load_record(reference_folder))
    print(verdict.summary)  # "parity: ... match the one-process run" or the first tensor that diverges
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_mlopt.distributed.sharding import data_parallel_size
from lightning_mlopt.distributed.state import full_parameters, gathered_over_pipeline
from lightning_mlopt.strategies.contract import contract_of

RECORD_NAME = "parity.pt"
DEEPSPEED_OWNS_GRADIENTS = "DeepSpeed's engine owns them"


class ParityRecorder(pl.Callback):
    """Records on rank zero what :func:`compare` needs, in ``out_dir/parity.pt``.

    Each step's loss over the whole job, the first step's full gradients and the final full parameters. The
    loss is averaged over every rank (collective, each step): the ranks of a tensor-parallel group hold the
    same loss, so the world's mean is the data-parallel groups' mean, the loss of the global batch. Under
    DeepSpeed no gradients, and the record says why: its engine reduces them into buffers and partitions of
    its own (ZeRO-2 leaves no ``.grad`` at all), so a parameter's ``.grad`` is not the step's gradient.

    Args:
        out_dir: the folder for ``parity.pt``.

    Example::

        trainer = Trainer(callbacks=[ParityRecorder("parity/parallel")], max_steps=4)

    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.losses: list[float] = []
        self.gradients: dict[str, Tensor] | None = None
        self.gradients_not_recorded = ""  # why not, when the strategy owns them; set in setup

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The strategy's declared answer: where dropping .grad would not skip the step, its engine owns the
        # gradients and .grad is not the step's gradient (DeepSpeed).
        if not contract_of(trainer.strategy).sharding.can_skip_step:
            self.gradients_not_recorded = DEEPSPEED_OWNS_GRADIENTS

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss = loss.detach().float().clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(float(loss))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.gradients is None and self.gradients_not_recorded:
            self.gradients = {}  # not the step's gradients: the engine holds those (see the class docstring)
        if self.gradients is None:  # the first step: before clipping and before any update
            # Copies: for an fp32 CPU gradient, .float().cpu() is the gradient itself, which clipping then
            # scales in place (the record of a clipped run held its clipped gradients, and a TP run's split
            # ones, gathered into new tensors, did not: a false divergence).
            self.gradients = {
                name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                .detach()
                .to("cpu", torch.float32, copy=True)
                for name, p in pl_module.named_parameters()
                if p.grad is not None
            }

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = full_parameters(pl_module)  # collective: every rank calls it
        gradients = gathered_over_pipeline(pl_module, self.gradients or {})  # every stage's (collective)
        if trainer.global_rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            record = {
                "losses": self.losses,
                "gradients": gradients,
                "parameters": {name: value.float() for name, value in params.items()},
                "data_parallel_size": data_parallel_size(trainer.strategy, trainer.world_size),
                "gradients_not_recorded": self.gradients_not_recorded,  # older records lack the key
            }
            torch.save(record, self.out_dir / RECORD_NAME)


def load_record(folder: Path) -> dict[str, Any]:
    """What :class:`ParityRecorder` wrote in ``folder``."""
    record: dict[str, Any] = torch.load(folder / RECORD_NAME, weights_only=True)
    return record


@dataclass(frozen=True)
class Tolerance:
    """``||a - b|| <= rtol * ||b||`` over a whole tensor: how far a tensor may be from the reference's.

    Over the whole tensor, not elementwise: Adam's first updates are about ``lr * sign(grad)``, so an element
    whose gradient is rounding noise moves by the learning rate either way, while the tensor stays close.
    fp32 sums taken in another order differ by ~1e-6 relative; bf16 by ~1e-2.
    """

    rtol: float

    def close(self, actual: Tensor, expected: Tensor) -> tuple[bool, float]:
        """Whether ``actual`` matches ``expected``, and their relative difference."""
        if actual.shape != expected.shape:
            return False, float("inf")
        scale = float(expected.norm())
        relative = float((actual - expected).norm()) / scale if scale > 0 else float((actual - expected).norm())
        return relative <= self.rtol, relative


FP32 = Tolerance(rtol=1e-3)
HALF = Tolerance(rtol=5e-2)


@dataclass(frozen=True)
class Verdict:
    """The comparison's outcome: whether the runs match, and the line (or lines) that say so."""

    matches: bool
    summary: str


def compare(parallel: dict[str, Any], reference: dict[str, Any], tolerance: Tolerance = FP32) -> Verdict:
    """Compare a configuration's record with the one-process reference's: losses, then gradients, then parameters.

    A record without gradients (DeepSpeed's: see :class:`ParityRecorder`) has its losses and parameters
    compared, and the verdict says the gradients were not, and why, rather than reporting them as compared.

    Example::

        >>> same = {"losses": [2.0, 1.5], "gradients": {"w": torch.ones(2)}, "parameters": {"w": torch.zeros(2)}}
        >>> compare(same, same).matches
        True
    """
    steps = min(len(parallel["losses"]), len(reference["losses"]))
    lines = []
    for step in range(steps):
        actual, expected = torch.tensor(parallel["losses"][step]), torch.tensor(reference["losses"][step])
        if not tolerance.close(actual, expected)[0]:
            lines.append(
                f"the loss diverges at step {step}: {float(actual):.6g} here, {float(expected):.6g} in one process"
            )
            break
    largest: dict[str, float] = {}
    # No gradients here: not compared, for the reason the record gives (DeepSpeed's engine owns them).
    skipped = "" if parallel["gradients"] else parallel.get("gradients_not_recorded") or "none were recorded"
    kinds = (("gradients", "at the first step"), ("parameters", f"after {steps} steps"))
    for kind, when in kinds[1:] if skipped else kinds:
        mine, theirs = parallel[kind], reference[kind]
        missing = sorted(set(theirs) - set(mine))
        if missing and mine:
            lines.append(f"{kind} missing here that one process has: {', '.join(missing[:5])}")
        largest[kind] = 0.0
        for name, expected in theirs.items():
            if name not in mine:
                continue
            close, difference = tolerance.close(mine[name], expected)
            largest[kind] = max(largest[kind], difference)
            if not close:
                lines.append(
                    f"first diverging {kind[:-1]} {when}: {name} (relative difference {difference:.3g}, "
                    f"tolerance {tolerance.rtol:g})"
                )
                break
    if lines:
        if skipped:
            lines.append(f"gradients not compared: {skipped}")
        return Verdict(False, "parity: DIVERGES from the one-process run\n" + "\n".join(f"  {line}" for line in lines))
    if skipped:
        return Verdict(
            True,
            f"parity: {steps} steps match the one-process run (losses and {len(reference['parameters'])} "
            f"parameters compared; gradients not compared: {skipped}; largest relative difference: parameter "
            f"{largest['parameters']:.2g})",
        )
    return Verdict(
        True,
        f"parity: {steps} steps match the one-process run (losses, {len(reference['gradients'])} gradients, "
        f"{len(reference['parameters'])} parameters; largest relative differences: gradient "
        f"{largest['gradients']:.2g}, parameter {largest['parameters']:.2g})",
    )
