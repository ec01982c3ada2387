"""GradNormMonitor: global gradient norms under every strategy, NaN localisation and a spike guard."""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_mlopt.distributed.grad_pieces import Piece, gradient_pieces, parameter_pieces

log = logging.getLogger(__name__)
Action = Literal["warn", "skip", "stop", "checkpoint_and_stop"]


class NonFiniteGradientError(RuntimeError):
    """Training stopped on a non-finite gradient or a spike; the message holds the diagnosis."""


def module_group(name: str, depth: int) -> str:
    """The module a parameter belongs to, cut to ``depth`` components: ``layers.3.attn.qkv.weight`` -> ``layers.3``.

    Example::

        >>> module_group("layers.3.attn.qkv.weight", 2)
        'layers.3'
        >>> module_group("token_embedding.weight", 2)
        'token_embedding'
    """
    module_path = name.split(".")[:-1] or name.split(".")
    return ".".join(module_path[:depth])


class GradNormMonitor(Callback):
    """Correct gradient norms under single device, DDP, FSDP and DeepSpeed ZeRO 1/2/3, cheaply.

    Every optimizer step: the global gradient norm (as if unsharded, replicated parameters counted once,
    squares summed in fp32) and the mean loss are computed with one fused ``_foreach_norm`` and packed into
    one all-reduce with each rank's non-finite report; one scalar vector is read on the host (as AMP's
    GradScaler does). On logging steps the same all-reduce also carries per-module sums, so per-module
    norms cost no extra collective.

    Non-finite values: when the gradient norm or loss is non-finite, every rank re-runs the step's forward pass
    (no gradients) with hooks that find the first module, in forward order, whose output is non-finite; the
    report names the step, the ranks and those modules (or, for a NaN born in backward, the modules with
    non-finite gradients). Healthy steps pay nothing for this. Then every rank takes the same action:
    ``warn``, ``skip`` (drop this optimizer step), ``stop`` (raise :class:`NonFiniteGradientError`), or
    ``checkpoint_and_stop`` (save through FaultTolerantCheckpoint first).

    Spikes: a loss or gradient norm more than ``spike_threshold`` standard deviations above the mean of the
    last ``spike_window`` steps triggers ``on_spike``. Statistics and counters are callback state, so a
    resumed run continues them.

    Logged under ``grad_norm/total``, ``grad_norm/total_clipped`` (when clipping by norm),
    ``grad_norm/<module>``, and optionally ``param_norm/<module>``, every ``log_every_n_steps``.

    Args:
        log_every_n_steps: log every N optimizer steps; None uses ``trainer.log_every_n_steps``.
        depth: module-name depth of the per-module norms (2: ``layers.3``); 0 turns them off.
        param_norms: also log per-module parameter norms (``param_norm/<module>``, ``param_norm/total``).
        update_ratios: also log ``update_ratio/<module>`` and ``update_ratio/total``, the norm of this step's
            parameter change over the parameter norm. Costs a copy of the (local) parameters and one more
            small all-reduce, on logging steps only.
        on_nonfinite: action on a non-finite gradient or loss.
        locate_nonfinite: on a non-finite step, re-run the forward pass to name the first module with a
            non-finite output (one extra forward, on bad steps only).
        on_spike: action on a loss or gradient-norm spike.
        spike_window: steps of history for the rolling mean and standard deviation.
        spike_threshold: how many standard deviations above the mean counts as a spike.
        spike_min_history: steps of history before spikes are judged at all.

    Raises:
        ValueError: a bad value.

    Example::

        trainer = Trainer(callbacks=[GradNormMonitor(depth=2, on_nonfinite="skip")], log_every_n_steps=50)

    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        depth: int = 2,
        param_norms: bool = False,
        update_ratios: bool = False,
        on_nonfinite: Action = "stop",
        locate_nonfinite: bool = True,
        on_spike: Action = "warn",
        spike_window: int = 100,
        spike_threshold: float = 6.0,
        spike_min_history: int = 20,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        if spike_window < 2:
            raise ValueError(f"spike_window must be >= 2, got {spike_window}")
        if spike_threshold <= 0:
            raise ValueError(f"spike_threshold must be > 0, got {spike_threshold}")
        for name, action in (("on_nonfinite", on_nonfinite), ("on_spike", on_spike)):
            if action not in ("warn", "skip", "stop", "checkpoint_and_stop"):
                raise ValueError(f"{name} must be warn, skip, stop or checkpoint_and_stop; got {action!r}")
        self.log_every_n_steps = log_every_n_steps
        self.depth = depth
        self.param_norms = param_norms
        self.update_ratios = update_ratios
        self._before_update: list[Tensor] | None = None
        self.on_nonfinite = on_nonfinite
        self.locate_nonfinite = locate_nonfinite
        self.on_spike = on_spike
        self.spike_window = spike_window
        self.spike_threshold = spike_threshold
        self.spike_min_history = spike_min_history
        # State that survives resume.
        self.loss_history: deque[float] = deque(maxlen=spike_window)
        self.norm_history: deque[float] = deque(maxlen=spike_window)
        self.nonfinite_events = 0
        self.spike_events = 0
        self.skipped_steps = 0
        # Per-run structures, built in setup.
        self._params: list[nn.Parameter] = []
        self._names: dict[int, str] = {}
        self._groups: list[str] = []
        self._group_of: dict[int, int] = {}
        self._modules: list[str] = []
        self._last_batch: tuple[Any, int] | None = None
        self._prefix = ""
        self._losses: list[Tensor] = []  # this rank's loss per micro-batch of the current step
        self._replicated = True
        self._plans: dict[tuple[Any, ...], tuple[Tensor | None, Tensor]] = {}
        self.last_metrics: dict[str, float] = {}

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(depth=self.depth, on_nonfinite=self.on_nonfinite)

    # ------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if "skip" in (self.on_nonfinite, self.on_spike) and _is_deepspeed(trainer.strategy):
            raise ValueError(
                "GradNormMonitor: 'skip' cannot drop a DeepSpeed step (the engine owns the update); "
                "use on_nonfinite/on_spike: stop, checkpoint_and_stop or warn"
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy's setup, not in `setup`: FSDP replaces parameters with sharded ones, and the
        # name and group tables are keyed by the parameters the optimizer will see.
        self._params = list(pl_module.parameters())
        names = [name for name, _ in pl_module.named_parameters()]
        prefix = _common_root(names)
        self._names = {id(p): name[len(prefix) :] for name, p in pl_module.named_parameters()}
        groups = dict.fromkeys(module_group(n, self.depth) for n in self._names.values()) if self.depth else {}
        self._groups = list(groups)
        index = {group: i for i, group in enumerate(self._groups)}
        self._group_of = {pid: index[module_group(n, self.depth)] for pid, n in self._names.items()} if groups else {}
        self._prefix = prefix
        # Replicated (single device, DDP): after backward every rank holds the same averaged gradients, so the
        # norms computed locally are the global ones, bitwise equal on every rank, and decisions taken from
        # them agree without a collective. Only the loss differs per rank: one 1-float all-reduce per step.
        # Sharded (FSDP, HSDP, ZeRO): one packed all-reduce of the weighted pieces and the loss per step.
        self._replicated = not _is_deepspeed(trainer.strategy) and not any(isinstance(p, DTensor) for p in self._params)

    def _first_nonfinite_module(self, pl_module: pl.LightningModule) -> int:
        """Re-run the last batch's forward with hooks; return 1 + the first bad module's index, or 0.

        "Bad" is a non-finite output; "first" is in forward order. Only on a bad step: healthy steps pay nothing.
        """
        if self._last_batch is None:
            return 0
        modules = [(name, module) for name, module in pl_module.named_modules() if name]
        self._modules = [n[len(self._prefix) :] if n.startswith(self._prefix) else n for n, _ in modules]
        first = [0]

        def make_hook(index: int) -> Any:
            def hook(module: nn.Module, inputs: Any, output: Any) -> None:
                tensor = output[0] if isinstance(output, (tuple, list)) and output else output
                floating = isinstance(tensor, Tensor) and tensor.is_floating_point()
                if first[0] == 0 and floating and not bool(torch.isfinite(tensor).all()):
                    first[0] = index

            return hook

        handles = [module.register_forward_hook(make_hook(i + 1)) for i, (_, module) in enumerate(modules)]
        batch, batch_idx = self._last_batch
        silenced = pl_module.log
        try:
            pl_module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]  # a diagnosis logs nothing
            with torch.no_grad():
                pl_module.training_step(batch, batch_idx)
        except Exception as error:
            log.warning("GradNormMonitor could not re-run the forward pass to locate the problem: %s", error)
        finally:
            pl_module.log = silenced  # type: ignore[method-assign]
            for handle in handles:
                handle.remove()
        return first[0]

    # ------------------------------------------------------------------ per step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._last_batch = (batch, batch_idx)  # a reference, not a copy: for re-running a bad step only

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._losses.append(loss.detach().float().reshape(1))

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step + 1  # the step this update makes
        every = int(self.log_every_n_steps or getattr(trainer, "log_every_n_steps", None) or 50)
        logging_step = step % every == 0
        per_group = logging_step and bool(self._groups)
        grad_sq, grad_groups, device = self._gradient_sums(trainer.strategy, per_group, pl_module.device)
        packed = [grad_sq.reshape(1)]
        if per_group:
            packed.append(grad_groups)
        if logging_step and self.param_norms:
            if self._replicated:
                tensors = [p.detach() for p in self._params]
                param_sq, param_groups = self._squares(self._params, tensors, None, per_group, device)
            else:
                param_sq, param_groups = self._sum_squares(list(parameter_pieces(self._params)), per_group, device)
            packed += [param_sq.reshape(1), param_groups] if per_group else [param_sq.reshape(1)]
        world = trainer.world_size
        loss = (torch.cat(self._losses).sum() if self._losses else torch.zeros(())).to(device) / world
        self._losses.clear()
        if world > 1 and self._replicated:
            # Every rank, every step: the loss mean, the one value that differs between ranks. Here, after
            # backward, not while it runs: an all-reduce issued in on_before_backward sits in the process
            # group's queue ahead of DDP's bucket all-reduces and stalls them (measured: +1.4% vs +0.1%).
            dist.all_reduce(loss)
        packed.append(loss.reshape(1))
        vector = torch.cat([t.float().to(device) for t in packed])
        if world > 1 and not self._replicated:
            dist.all_reduce(vector)  # every rank, every step: one packed collective (sharded strategies)
        values = vector.tolist()  # the one host sync of the step
        if logging_step and self.update_ratios:
            # Snapshot this rank's parameter pieces; compared after the optimizer step in on_train_batch_end.
            self._before_update = [piece.tensor.detach().clone() for piece in parameter_pieces(self._params)]
        self._act(trainer, pl_module, optimizer, values, logging_step, per_group, step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._before_update is None:
            return
        before, self._before_update = self._before_update, None
        after = list(parameter_pieces(self._params))
        device = before[0].device if before else pl_module.device
        deltas = torch._foreach_sub([piece.tensor.detach() for piece in after], before)
        delta_pieces = [
            Piece(piece.param, delta, piece.replication) for piece, delta in zip(after, deltas, strict=True)
        ]
        per_group = bool(self._groups)
        delta_sq, delta_groups = self._sum_squares(delta_pieces, per_group, device)
        param_sq, param_groups = self._sum_squares(after, per_group, device)
        vector = torch.cat([delta_sq.reshape(1), param_sq.reshape(1), delta_groups, param_groups])
        if self._replicated:
            vector.mul_(trainer.world_size)  # this rank's sums are the global ones (see on_fit_start)
        elif trainer.world_size > 1:
            dist.all_reduce(vector)  # every rank, on logging steps only
        values = vector.tolist()
        count = len(self._groups)

        def ratio(delta: float, param: float) -> float:
            return math.sqrt(max(delta, 0.0)) / math.sqrt(param) if param > 0 else 0.0

        metrics = {"update_ratio/total": ratio(values[0], values[1])}
        for index, group in enumerate(self._groups):
            metrics[f"update_ratio/{group}"] = ratio(values[2 + index], values[2 + count + index])
        self.last_metrics = {**self.last_metrics, **metrics}
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _sum_squares(self, pieces: list[Piece], per_group: bool, device: torch.device) -> tuple[Tensor, Tensor]:
        """Total and per-group sums of squares, each piece divided by its replication, in fp32."""
        tensors = [p.tensor for p in pieces]
        return self._squares([p.param for p in pieces], tensors, [p.replication for p in pieces], per_group, device)

    def _gradient_sums(self, strategy: Any, per_group: bool, default: torch.device) -> tuple[Tensor, Tensor, Any]:
        """Sum of squares of the gradients (total, per group) and their device; summed over ranks when sharded."""
        if self._replicated:
            # The common case, kept lean: plain tensors, no per-piece bookkeeping, no weights.
            with_grad = [p for p in self._params if p.grad is not None]
            tensors: list[Tensor] = [p.grad for p in with_grad]  # type: ignore[misc]
            device = tensors[0].device if tensors else default
            return (*self._squares(with_grad, tensors, None, per_group, device), device)
        pieces = list(gradient_pieces(self._params, strategy))
        device = pieces[0].tensor.device if pieces else default
        return (*self._sum_squares(pieces, per_group, device), device)

    def _squares(
        self,
        params: list[nn.Parameter],
        tensors: list[Tensor],
        replications: list[int] | None,
        per_group: bool,
        device: torch.device,
    ) -> tuple[Tensor, Tensor]:
        """Total and per-group sums of squares of ``tensors`` (one per entry of ``params``), in fp32.

        With ``replications``, each square is divided by its piece's replication (sharded strategies).
        """
        groups = torch.zeros(len(self._groups), device=device)
        if not tensors:
            return torch.zeros((), device=device), groups
        # Empty pieces (a rank's share of a small FSDP parameter) have norm 0: no need to filter them out.
        squares = torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32)).to(device).pow_(2)
        if replications is not None or per_group:
            weights, index = self._plan(params, device, replications)
            if weights is not None:
                squares.mul_(weights)
            if per_group:
                groups.index_add_(0, index, squares)
        return squares.sum(), groups

    def _plan(
        self, params: list[nn.Parameter], device: torch.device, replications: list[int] | None = None
    ) -> tuple[Tensor | None, Tensor]:
        """Per-entry weights (1 / replication; None without replications) and group indices.

        Built once per list of parameters: the parameters holding gradients do not change between steps.
        """
        key = (replications is not None, *[id(p) for p in params])  # a list, not a generator: faster
        plan = self._plans.get(key)
        if plan is None:
            if self._groups and any(id(p) not in self._group_of for p in params):
                raise RuntimeError("GradNormMonitor: a gradient belongs to no known parameter (did the model change?)")
            weights = None if replications is None else torch.tensor([1.0 / r for r in replications], device=device)
            index = torch.tensor([self._group_of.get(id(p), 0) for p in params], device=device)
            plan = self._plans[key] = (weights, index)
        return plan

    # ------------------------------------------------------------------ decisions

    def _act(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Any,
        values: list[float],
        logging_step: bool,
        per_group: bool,
        step: int,
    ) -> None:
        total = math.sqrt(values[0]) if values[0] >= 0 else float("nan")
        cursor = 1
        group_values = values[cursor : cursor + len(self._groups)] if per_group else []
        cursor += len(group_values)
        param_total, param_groups = None, []
        if logging_step and self.param_norms:
            param_total = math.sqrt(values[cursor])
            cursor += 1
            if per_group:
                param_groups = values[cursor : cursor + len(self._groups)]
                cursor += len(self._groups)
        loss = values[cursor]

        if not math.isfinite(total) or not math.isfinite(loss):
            self.nonfinite_events += 1
            first_bad = self._gather_first_nonfinite(trainer, pl_module)
            pieces = list(gradient_pieces(self._params, trainer.strategy))  # only on a bad step
            report = self._nonfinite_report(trainer, pl_module, step, first_bad, pieces, total, loss)
            self._take(self.on_nonfinite, report, trainer, optimizer)
            return
        spike = self._spike(loss, total)
        if spike:
            self.spike_events += 1
            self._take(self.on_spike, f"step {step}: {spike}", trainer, optimizer)
        else:
            self.loss_history.append(loss)
            self.norm_history.append(total)
        if logging_step:
            self._log(trainer, step, total, group_values, param_total, param_groups)

    def _gather_first_nonfinite(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[int]:
        """Each rank's first bad module, in one all-reduce of per-rank slots.

        Every rank re-runs its forward; all ranks reach this, because the decision to call it was collective.
        """
        world = trainer.world_size
        slots = torch.zeros(world, device=pl_module.device)
        if self.locate_nonfinite:
            slots[trainer.global_rank] = float(self._first_nonfinite_module(pl_module))
        if world > 1:
            dist.all_reduce(slots)
        return [int(v) for v in slots.tolist()]

    def _spike(self, loss: float, norm: float) -> str | None:
        for label, value, history in (("loss", loss, self.loss_history), ("gradient norm", norm, self.norm_history)):
            if len(history) < max(2, self.spike_min_history):
                continue
            mean = sum(history) / len(history)
            std = math.sqrt(sum((x - mean) ** 2 for x in history) / (len(history) - 1))
            if value > mean + self.spike_threshold * max(std, 1e-12):
                return (
                    f"{label} spike: {value:.4g} is more than {self.spike_threshold:g} standard deviations above "
                    f"the mean {mean:.4g} (std {std:.3g}) of the last {len(history)} steps"
                )
        return None

    def _nonfinite_report(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        first_bad: list[int],
        grads: list[Piece],
        total: float,
        loss: float,
    ) -> str:
        lines = [f"non-finite values at step {step} (gradient norm {total}, mean loss {loss})"]
        culprits = [(rank, self._modules[index - 1]) for rank, index in enumerate(first_bad) if index > 0]
        if culprits:
            for rank, module in culprits:
                lines.append(f"  rank {rank}: first non-finite output in forward order: {module}")
        else:
            # Born in backward: the forward was finite everywhere. Name the modules whose gradients are not.
            bad_groups = self._nonfinite_gradient_groups(grads)
            lines.append(
                "  the forward pass was finite on every rank; modules with non-finite gradients on rank "
                f"{trainer.global_rank}: {', '.join(bad_groups) or 'none here'}"
            )
        return "\n".join(lines)

    def _nonfinite_gradient_groups(self, grads: list[Piece]) -> list[str]:
        bad = []
        for piece in grads:
            if piece.tensor.numel() and not bool(torch.isfinite(piece.tensor).all()):
                name = self._names.get(id(piece.param), "?")
                bad.append(module_group(name, max(self.depth, 1)))
        return list(dict.fromkeys(bad))

    def _take(self, action: Action, report: str, trainer: pl.Trainer, optimizer: Any) -> None:
        """Apply an action every rank agreed on (they all read the same reduced values)."""
        if action == "warn":
            rank_zero_warn(f"GradNormMonitor: {report}")
            return
        if action == "skip":
            self.skipped_steps += 1
            rank_zero_warn(f"GradNormMonitor: {report}\n  skipping this optimizer step")
            # Optimizers leave parameters without a gradient untouched: the step becomes a no-op.
            for group in getattr(optimizer, "param_groups", []):
                for param in group["params"]:
                    param.grad = None
            return
        if action == "checkpoint_and_stop":
            from lightning_mlopt.callbacks.fault_tolerant_checkpoint import FaultTolerantCheckpoint

            savers = [cb for cb in trainer.callbacks if isinstance(cb, FaultTolerantCheckpoint)]  # type: ignore[attr-defined]
            if savers:
                savers[0].save(trainer, reason="nonfinite", wait=True)  # the state before this update
                report += f"\n  saved a checkpoint at step {trainer.global_step} (before this update)"
            else:
                report += "\n  no FaultTolerantCheckpoint in the Trainer: nothing was saved"
        raise NonFiniteGradientError(f"GradNormMonitor stopped training: {report}")

    def _log(
        self,
        trainer: pl.Trainer,
        step: int,
        total: float,
        groups: list[float],
        param_total: float | None,
        param_groups: list[float],
    ) -> None:
        metrics = {"grad_norm/total": total}
        clip = trainer.gradient_clip_val
        if clip and (trainer.gradient_clip_algorithm or "norm") == "norm":
            metrics["grad_norm/total_clipped"] = total * min(1.0, float(clip) / (total + 1e-6))
        metrics.update({f"grad_norm/{g}": math.sqrt(max(v, 0.0)) for g, v in zip(self._groups, groups, strict=False)})
        if param_total is not None:
            metrics["param_norm/total"] = param_total
            metrics.update(
                {f"param_norm/{g}": math.sqrt(max(v, 0.0)) for g, v in zip(self._groups, param_groups, strict=False)}
            )
        self.last_metrics = metrics
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    # ------------------------------------------------------------------ state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_history": list(self.loss_history),
            "norm_history": list(self.norm_history),
            "nonfinite_events": self.nonfinite_events,
            "spike_events": self.spike_events,
            "skipped_steps": self.skipped_steps,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loss_history = deque(state_dict.get("loss_history", []), maxlen=self.spike_window)
        self.norm_history = deque(state_dict.get("norm_history", []), maxlen=self.spike_window)
        self.nonfinite_events = state_dict.get("nonfinite_events", 0)
        self.spike_events = state_dict.get("spike_events", 0)
        self.skipped_steps = state_dict.get("skipped_steps", 0)


def _common_root(names: list[str]) -> str:
    """``model.`` when every parameter lives under one attribute of the LightningModule, else empty."""
    roots = {name.split(".", 1)[0] for name in names}
    return f"{roots.pop()}." if len(roots) == 1 and all("." in n for n in names) else ""


def _is_deepspeed(strategy: Any) -> bool:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return isinstance(strategy, DeepSpeedStrategy)
