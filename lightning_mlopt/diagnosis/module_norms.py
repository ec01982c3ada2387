"""A model's gradient and parameter norms on one rank: in total and per module group, under any sharding.

The numbers are this rank's share (sums of squares, weighted by 1 / replication where the model is sharded);
the caller reduces them, packed with whatever else the step exchanges. Where every rank holds the whole,
identical gradients (:attr:`ModuleNorms.replicated`), the local sums are the global ones and need no
collective. The arithmetic is the package's one algorithm,
:func:`~lightning_mlopt.distributed.grad_norm.sums_of_squares`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mlopt._compat import foreach_sub
from lightning_mlopt.diagnosis.module_names import common_root, module_group
from lightning_mlopt.diagnosis.nonfinite import nonfinite_gradient_modules
from lightning_mlopt.distributed.grad_norm import sums_of_squares
from lightning_mlopt.distributed.packed import Packed
from lightning_mlopt.distributed.sharding import Piece, Sharding


class ModuleNorms:
    """Name and group tables for ``module``'s parameters, and their sums of squares each step.

    Build it after the strategy has set the model up: FSDP replaces parameters with sharded ones, and the
    tables are keyed by the parameters the optimizer sees.

    Args:
        module: the model (a LightningModule); a single wrapper attribute (``model.``) is left out of names.
        sharding: what each rank holds (``strategies.contract.contract_of(trainer.strategy).sharding``).
        depth: module-name depth of the groups (2: ``layers.3``); 0: no groups.

    Example::

        norms = ModuleNorms(pl_module, contract_of(trainer.strategy).sharding, depth=2)
        total, groups, device = norms.gradient_sums(per_group=True, default=pl_module.device)
        if not norms.replicated:
            dist.all_reduce(total)  # and groups: better, packed into one vector
        print(total.sqrt(), dict(zip(norms.groups, groups.sqrt().tolist())))

    """

    def __init__(self, module: nn.Module, sharding: Sharding, depth: int) -> None:
        self.sharding = sharding
        self.depth = depth
        self.params: list[Tensor] = list(module.parameters())
        # Pipeline stages hold different parameters: groups are laid out on the whole model's names, so every
        # rank's per-group vector has the same slots (summed over the world).
        every = getattr(sharding, "model_parameter_names", None) or [name for name, _ in module.named_parameters()]
        self.prefix = common_root(list(every))
        self.names = {id(p): name[len(self.prefix) :] for name, p in module.named_parameters()}
        laid_out = [name[len(self.prefix) :] for name in every]
        groups = dict.fromkeys(module_group(n, depth) for n in laid_out) if depth else {}
        self.groups: list[str] = list(groups)
        index = {group: i for i, group in enumerate(self.groups)}
        self._group_of = {pid: index[module_group(n, depth)] for pid, n in self.names.items()} if groups else {}
        self.replicated = sharding.gradients_replicated(self.params)
        self._plans: dict[tuple[Any, ...], tuple[Tensor | None, Tensor]] = {}

    def gradient_sums(self, per_group: bool, default: torch.device) -> tuple[Tensor, Tensor, torch.device]:
        """The gradients' sums of squares on this rank (total, per group) and the device they are on."""
        if self.replicated:
            # The common case, kept lean: plain tensors, no per-piece bookkeeping, no weights.
            with_grad = [p for p in self.params if p.grad is not None]
            tensors: list[Tensor] = [p.grad for p in with_grad]  # type: ignore[misc]
            device = tensors[0].device if tensors else default
            return (*self._sums(with_grad, tensors, None, per_group, device), device)
        pieces = list(self.sharding.gradient_pieces(self.params))
        device = pieces[0].tensor.device if pieces else default
        return (*self.sums_of_pieces(pieces, per_group, device), device)

    def parameter_pieces(self) -> list[Piece]:
        """The parameter pieces this rank holds."""
        return list(self.sharding.parameter_pieces(self.params))

    def parameter_sums(self, per_group: bool, device: torch.device) -> tuple[Tensor, Tensor]:
        """The parameters' sums of squares on this rank (total, per group)."""
        return self.sums_of_pieces(self.parameter_pieces(), per_group, device)

    def snapshot_parameters(self) -> list[Tensor]:
        """Copies of this rank's parameter pieces, to compare with after the optimizer step."""
        return [piece.tensor.detach().clone() for piece in self.parameter_pieces()]

    def update_ratios(self, before: list[Tensor], world_size: int, default: torch.device) -> dict[str, float]:
        """``update_ratio/<group>`` and ``/total``: the norm of the change since ``before`` over the norm now.

        Collective unless replicated: every rank calls it with its own snapshot (its own small all-reduce).
        """
        after = self.parameter_pieces()
        device = before[0].device if before else default
        deltas = foreach_sub([piece.tensor.detach() for piece in after], before)
        delta_pieces = [Piece(p.param, delta, p.replication) for p, delta in zip(after, deltas, strict=True)]
        packed = Packed()
        for name, pieces in (("delta", delta_pieces), ("param", after)):
            total, groups = self.sums_of_pieces(pieces, True, device)
            packed.add(f"{name}_sq", total)
            packed.add(f"{name}_groups", groups)
        vector = packed.tensor(device)
        if not self.replicated and world_size > 1:
            dist.all_reduce(vector)
        values = packed.unpack(vector.tolist())

        def ratio(delta: float, param: float) -> float:
            return math.sqrt(max(delta, 0.0)) / math.sqrt(param) if param > 0 else 0.0

        metrics = {"update_ratio/total": ratio(values["delta_sq"][0], values["param_sq"][0])}
        for index, group in enumerate(self.groups):
            metrics[f"update_ratio/{group}"] = ratio(values["delta_groups"][index], values["param_groups"][index])
        return metrics

    def metrics(self, prefix: str, total: float, group_squares: list[float]) -> dict[str, float]:
        """``<prefix>/total`` and ``<prefix>/<group>`` from a total norm and the groups' sums of squares."""
        metrics = {f"{prefix}/total": total}
        for group, squares in zip(self.groups, group_squares, strict=False):
            metrics[f"{prefix}/{group}"] = math.sqrt(max(squares, 0.0))
        return metrics

    def nonfinite_gradient_modules(self) -> list[str]:
        """The module groups whose gradient pieces on this rank hold a non-finite value."""
        return nonfinite_gradient_modules(list(self.sharding.gradient_pieces(self.params)), self.names, self.depth)

    def sums_of_pieces(self, pieces: list[Piece], per_group: bool, device: torch.device) -> tuple[Tensor, Tensor]:
        """Total and per-group sums of squares, each piece divided by its replication, in fp32.

        Replicated: every rank holds every piece whole, and the local sums are the global ones as they are.
        """
        tensors = [p.tensor for p in pieces]
        replications = None if self.replicated else [p.replication for p in pieces]
        return self._sums([p.param for p in pieces], tensors, replications, per_group, device)

    def _sums(
        self,
        params: list[Tensor],
        tensors: list[Tensor],
        replications: list[int] | None,
        per_group: bool,
        device: torch.device,
    ) -> tuple[Tensor, Tensor]:
        weights, index = None, None
        if tensors and (replications is not None or per_group):
            weights, index = self._plan(params, device, replications)
        return sums_of_squares(tensors, device, weights, index if per_group else None, len(self.groups))

    def _plan(
        self, params: list[Tensor], device: torch.device, replications: list[int] | None
    ) -> tuple[Tensor | None, Tensor]:
        """Per-entry weights (1 / replication; None without replications) and group indices.

        Built once per list of parameters and replications: the parameters holding gradients do not change
        between steps. A parameter's replication is not always its gradient's: under tensor parallelism a
        row-wise embedding's weight is split (``Shard(0)``) while torch hands back its gradient whole
        (``Replicate()``), so both are part of the key.
        """
        key = (None if replications is None else tuple(replications), *[id(p) for p in params])
        plan = self._plans.get(key)
        if plan is None:
            if self.groups and any(id(p) not in self._group_of for p in params):
                raise RuntimeError("GradNormMonitor: a gradient belongs to no known parameter (did the model change?)")
            weights = None if replications is None else torch.tensor([1.0 / r for r in replications], device=device)
            index = torch.tensor([self._group_of.get(id(p), 0) for p in params], device=device)
            plan = self._plans[key] = (weights, index)
        return plan
