"""Re-running a bad step, to tell a transient fault (the hardware) from a reproducible one (data or model).

When a step's gradients are non-finite or spike, every rank re-runs its last micro-batch with the same
inputs and the RNG state it had when the batch started (:func:`rerun_step`); comparing with what the step
produced tells them apart (:func:`classify`). Megatron-LM's rerun state machine does the same for NaNs and
spikes; here it runs inside the step, on every strategy, and costs nothing on healthy steps but a copy of the
torch RNG state at each batch start.

Example::

    >>> label, why = classify("nonfinite", original=[2.3, float("nan")], rerun=[2.3, 2.4],
    ...                       gradients_finite=[None, None], hosts=["a", "b"])
    >>> label, why.split(":")[0]
    ('transient', 'transient on rank 1 (host b)')
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch

from lightning_mlopt.diagnosis.nonfinite import watching_outputs

log = logging.getLogger(__name__)

SAME_LOSS_RTOL = 1e-5  # a re-run on the same device with the same inputs and RNG gives the same loss


class Rerun(NamedTuple):
    """A rank's re-run of a step.

    Its loss (NaN when it could not re-run), whether its gradients were finite, and (when located) 1 + the
    index in ``modules`` of the first module with a non-finite output (0: none).
    """

    loss: float
    gradients_finite: bool | None  # None: the backward was not re-run
    first_nonfinite: int = 0
    modules: tuple[str, ...] = ()  # the names ``first_nonfinite`` indexes (a tuple: a default shared by all)


def capture_torch_rng() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch CPU and current-CUDA-device RNG states (what a training step draws dropout from)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def restore_torch_rng(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    """Put the torch RNGs back to ``state``."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def rerun_step(
    pl_module: Any,
    batch: Any,
    batch_idx: int,
    rng: tuple[torch.Tensor, torch.Tensor | None] | None,
    with_backward: bool,
    locate: bool = False,
) -> Rerun:
    """Re-run ``training_step`` on ``batch`` from RNG state ``rng``; gradients into a scratch list, not ``.grad``.

    ``rng`` None: from the RNG state as it is. The backward (``with_backward``) only where it needs no
    collective (one device, DDP: ``torch.autograd.grad`` runs none of DDP's reducer hooks). ``locate``: hooks
    on every module find the first non-finite output in the same pass. The RNGs are put back afterwards, so
    training goes on as if the re-run never happened; logging from the re-run is silenced.
    """
    current = capture_torch_rng()
    silenced = pl_module.log
    first: list[int] = [0]
    modules: list[str] = []
    try:
        if rng is not None:
            restore_torch_rng(rng)
        pl_module.log = lambda *args, **kwargs: None
        watch: AbstractContextManager[tuple[list[int], list[str]]] = (
            watching_outputs(pl_module) if locate else nullcontext(([0], []))
        )
        grad_mode: AbstractContextManager[Any] = torch.enable_grad() if with_backward else torch.no_grad()
        with grad_mode, watch as (first, modules):
            output = pl_module.training_step(batch, batch_idx)
        loss = output["loss"] if isinstance(output, dict) else output
        if not isinstance(loss, torch.Tensor):
            return Rerun(float("nan"), None, first[0], tuple(modules))
        finite = None
        if with_backward:
            params = [param for param in pl_module.parameters() if param.requires_grad]
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            finite = all(bool(torch.isfinite(grad).all()) for grad in grads if grad is not None)
        return Rerun(float(loss.detach().float()), finite, first[0], tuple(modules))
    except Exception as error:
        log.warning("could not re-run the step to classify or locate the anomaly: %s", error)
        return Rerun(float("nan"), None, first[0], tuple(modules))
    finally:
        pl_module.log = silenced
        restore_torch_rng(current)


def classify(
    kind: str,
    original: Sequence[float],
    rerun: Sequence[float],
    gradients_finite: Sequence[bool | None],
    hosts: Sequence[str],
) -> tuple[str, str]:
    """``(label, explanation)``: label ``reproducible``, ``transient`` or ``unclassified``; per-rank inputs.

    ``kind`` is ``nonfinite`` or ``spike``; ``original`` is each rank's own loss in the step, ``rerun`` its
    loss in the re-run, ``gradients_finite`` whether its re-run backward was finite (None: not re-run).
    """
    ranks = range(len(original))
    if kind == "spike":
        moved = [r for r in ranks if not _same(original[r], rerun[r])]
        if not moved:
            return "reproducible", "reproducible: every rank's re-run gives the same loss (the data or the model)"
        return "transient", "transient on " + _on(moved, hosts) + ": the re-run loss differs; suspect the hardware"
    origin = [r for r in ranks if not math.isfinite(original[r])]
    if origin:  # born in a forward
        again = [r for r in origin if not math.isfinite(rerun[r])]
        if again:
            return "reproducible", (
                f"reproducible on {_on(again, hosts)}: the re-run with the same inputs and RNG state is "
                "non-finite again (the data or the model)"
            )
        return "transient", (
            f"transient on {_on(origin, hosts)}: its loss was non-finite, the re-run with the same inputs and RNG "
            "state is finite; suspect that rank's hardware"
        )
    if all(finite is None for finite in gradients_finite):
        return "unclassified", (
            "unclassified: the losses were finite, and re-running a backward under a sharded strategy needs "
            "every rank's collectives"
        )
    bad = [r for r in ranks if gradients_finite[r] is False]
    if bad:
        return "reproducible", f"reproducible on {_on(bad, hosts)}: its re-run backward is non-finite again"
    return "transient", (
        "transient: every rank's re-run backward is finite (the rank cannot be told: gradients are averaged "
        "before any check); suspect the hardware"
    )


def _same(a: float, b: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= SAME_LOSS_RTOL * max(abs(a), abs(b), 1e-12)


def _on(ranks: Sequence[int], hosts: Sequence[str]) -> str:
    named = [f"{rank} (host {hosts[rank]})" if rank < len(hosts) else str(rank) for rank in ranks]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(named)


def first_nonfinite_output(pl_module: Any, batch: Any, batch_idx: int) -> tuple[int, list[str]]:
    """Re-run ``pl_module.training_step(batch, batch_idx)`` without gradients; find the first bad module.

    Returns:
        ``(1 + index of the first module with a non-finite floating output, or 0 when none had one;
        the names of the modules in the order indexed)``. Logging from the re-run step is silenced.

    Example::

        index, names = first_nonfinite_output(pl_module, batch, batch_idx)
        culprit = names[index - 1] if index else None

    """
    rerun = rerun_step(pl_module, batch, batch_idx, rng=None, with_backward=False, locate=True)
    return rerun.first_nonfinite, list(rerun.modules)
