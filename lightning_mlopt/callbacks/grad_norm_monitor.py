# long: norms, the non-finite and spike guards and rerun attribution share one exchange; the math is in diagnosis/
"""GradNormMonitor: global gradient norms under every strategy, NaN localisation and a spike guard."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_mlopt._compat import callback_state_key, loss_scale
from lightning_mlopt._metrics import log_metrics, logging_period
from lightning_mlopt.diagnosis import inject
from lightning_mlopt.diagnosis.loss_scale_floor import LossScaleFloor
from lightning_mlopt.diagnosis.module_names import module_group
from lightning_mlopt.diagnosis.module_norms import ModuleNorms
from lightning_mlopt.diagnosis.nonfinite import nonfinite_report
from lightning_mlopt.diagnosis.rerun import Rerun, capture_torch_rng, classify, rerun_step
from lightning_mlopt.diagnosis.spikes import SpikeDetector
from lightning_mlopt.distributed.packed import Packed
from lightning_mlopt.distributed.sharding import Sharding, TensorSharding
from lightning_mlopt.distributed.step_exchange import step_exchange
from lightning_mlopt.exceptions import NonFiniteGradientError
from lightning_mlopt.hooks import checkpoint_events, pipeline_of
from lightning_mlopt.strategies.contract import contract_of

Action = Literal["warn", "skip", "stop", "checkpoint_and_stop"]
_SLOT = "grad_norm."  # this monitor's names in the step exchange

__all__ = ["GradNormMonitor", "NonFiniteGradientError", "module_group"]


class GradNormMonitor(Callback):
    """Correct gradient norms under single device, DDP, FSDP and DeepSpeed ZeRO 1/2/3, cheaply.

    Every optimizer step: the global gradient norm (as if unsharded, replicated parameters counted once,
    squares summed in fp32; see ``distributed/grad_norm.py``) and the mean loss are computed with one fused
    ``_foreach_norm`` and go into the batch's one exchange (``distributed/step_exchange.py``), which also
    carries other callbacks' per-step values (FaultTolerantCheckpoint's signal and timer flags); one scalar
    vector is read on the host (as AMP's GradScaler does). On logging steps the same exchange also carries
    per-module sums, so per-module norms cost no extra collective.

    Non-finite values: when the gradient norm or loss is non-finite, every rank re-runs the step's forward pass
    (no gradients) with hooks that find the first module, in forward order, whose output is non-finite; the
    report names the step, the ranks and those modules (or, for a NaN born in backward, the modules with
    non-finite gradients). Healthy steps pay nothing for this. Then every rank takes the same action:
    ``warn``, ``skip`` (drop this optimizer step), ``stop`` (raise :class:`NonFiniteGradientError`), or
    ``checkpoint_and_stop`` (the same error, asking FaultTolerantCheckpoint to save the state before this
    update first; it does so on every rank in its ``on_exception``).

    Spikes: a loss or gradient norm more than ``spike_threshold`` standard deviations above the mean of the
    last ``spike_window`` steps triggers ``on_spike``; each optimizer (several under manual optimization) has a
    history of its own. Statistics and counters are callback state, so a resumed run continues them.

    fp16 mixed precision: an overflow (non-finite gradients, finite loss) is the loss scaler's to skip (AMP's
    GradScaler, or DeepSpeed's engine, whose still-scaled gradients are divided by its scale here), until one
    overflows at a scale already at or below ``min_loss_scale``: that is a blow-up, handled as non-finite.

    Rerun attribution (``rerun_on_anomaly``): before acting on a non-finite step or a spike, every rank
    re-runs its last micro-batch with the same inputs and the RNG state it started from (the backward too
    where that needs no collective: one device, DDP) and the report says ``reproducible`` (the same result
    again: the data or the model), ``transient`` (not reproduced: suspect the hardware of the named rank and
    host) or ``unclassified``; ``grad_norm/rerun_transient`` is logged. Healthy steps pay a copy of the
    torch RNG state at batch start. (Whether another replica reproduces it on its own hardware, which would
    tell a persistent fault of one rank, is not tried.)

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
        rerun_on_anomaly: re-run a bad step's last micro-batch to classify it (see above); off costs nothing.
        min_loss_scale: fp16: an overflow at a loss scale (GradScaler's or DeepSpeed's) at or below this is
            non-finite, not the scaler's; None: every overflow is the scaler's.

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
        rerun_on_anomaly: bool = True,
        min_loss_scale: float | None = 1.0,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        for name, action in (("on_nonfinite", on_nonfinite), ("on_spike", on_spike)):
            if action not in ("warn", "skip", "stop", "checkpoint_and_stop"):
                raise ValueError(f"{name} must be warn, skip, stop or checkpoint_and_stop; got {action!r}")
        self.spikes = SpikeDetector(spike_window, spike_threshold, spike_min_history)  # validates its values
        self._other_spikes: list[SpikeDetector] = []  # optimizers 1.. (manual optimization): their own histories
        self.scale_floor = LossScaleFloor(min_loss_scale)  # validates it
        self.log_every_n_steps = log_every_n_steps
        self.depth = depth
        self.param_norms = param_norms
        self.update_ratios = update_ratios
        self.on_nonfinite = on_nonfinite
        self.locate_nonfinite = locate_nonfinite
        self.on_spike = on_spike
        self.rerun_on_anomaly = rerun_on_anomaly
        self.last_rerun: str | None = None  # the classification of the last anomaly ("transient", ...)
        self._rerun_metrics: dict[str, float] = {}  # logged with the step's norms, or at once
        # State that survives resume (with the spike history).
        self.nonfinite_events = 0
        self.scaler_skipped_steps = 0  # fp16 AMP: updates the GradScaler skipped (non-finite gradients, finite loss)
        self.skipped_steps = 0
        # Per-run structures, built in setup and on_fit_start.
        self._sharding: Sharding = TensorSharding()
        self._norms = ModuleNorms(nn.Module(), self._sharding, depth)  # the real one at on_fit_start
        self._last_batch: tuple[Any, int] | None = None
        self._batch_rng: tuple[Tensor, Tensor | None] | None = None  # the RNG state the last batch started from
        self._local_loss: Tensor | None = None  # this rank's own loss in the last micro-batch
        self._losses: list[Tensor] = []  # this rank's loss per micro-batch of the current step
        self._injected: list[Any] = []  # hooks of LIGHTNING_MLOPT_INJECT nan faults (a testing aid)
        self._before_update: list[Tensor] | None = None
        self.last_metrics: dict[str, float] = {}

    @property
    @override
    def state_key(self) -> str:
        return callback_state_key(self, depth=self.depth, on_nonfinite=self.on_nonfinite)

    @property
    def spike_window(self) -> int:
        """Steps of history the spike detector keeps."""
        return self.spikes.window

    @property
    def spike_threshold(self) -> float:
        """Standard deviations above the mean that count as a spike."""
        return self.spikes.threshold

    @property
    def spike_min_history(self) -> int:
        """Steps of history before spikes are judged."""
        return self.spikes.min_history

    @property
    def loss_history(self) -> deque[float]:
        """The spike detector's recent losses."""
        return self.spikes.loss_history

    @property
    def norm_history(self) -> deque[float]:
        """The spike detector's recent gradient norms."""
        return self.spikes.norm_history

    @property
    def spike_events(self) -> int:
        """Spikes seen so far in the run (across resumes), every optimizer's."""
        return self.spikes.events + sum(detector.events for detector in self._other_spikes)

    @spike_events.setter
    def spike_events(self, value: int) -> None:
        self.spikes.events = value

    @staticmethod
    def _optimizer_index(trainer: pl.Trainer, optimizer: Any) -> int:
        return next((i for i, known in enumerate(trainer.optimizers) if known is optimizer), 0)

    def spikes_of(self, trainer: pl.Trainer, optimizer: Any) -> SpikeDetector:
        """The spike history of ``optimizer``: a loss of one optimizer is no yardstick for another's."""
        index = self._optimizer_index(trainer, optimizer)
        while index > len(self._other_spikes):
            first = self.spikes
            self._other_spikes.append(SpikeDetector(first.window, first.threshold, first.min_history))
        return self.spikes if index == 0 else self._other_spikes[index - 1]

    # ------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._sharding = contract_of(trainer.strategy).sharding
        if "skip" in (self.on_nonfinite, self.on_spike) and not self._sharding.can_skip_step:
            raise ValueError(
                "GradNormMonitor: 'skip' cannot drop a DeepSpeed step (the engine owns the update); "
                "use on_nonfinite/on_spike: stop, checkpoint_and_stop or warn"
            )
        self._injected = [
            inject.install_nan(pl_module, injection, trainer.global_rank, lambda: trainer.global_step)
            for injection in inject.from_environment("nan")
        ]

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy's setup, not in `setup`: FSDP replaces parameters with sharded ones, and the
        # name and group tables are keyed by the parameters the optimizer will see.
        # Replicated (single device, DDP): after backward every rank holds the same averaged gradients, so the
        # norms computed locally are the global ones, bitwise equal on every rank, and decisions taken from
        # them agree without a collective. Only the loss differs per rank: one 1-float all-reduce per step.
        # Sharded (FSDP, HSDP, ZeRO): one packed all-reduce of the weighted pieces and the loss per step.
        self._norms = ModuleNorms(pl_module, self._sharding, self.depth)
        # Here, not in setup: the checkpointing callback sets up last (Lightning orders checkpoints last).
        stops_with_a_save = "checkpoint_and_stop" in (self.on_nonfinite, self.on_spike)
        if stops_with_a_save and checkpoint_events(trainer).store is None:
            rank_zero_warn(
                "GradNormMonitor: checkpoint_and_stop without a FaultTolerantCheckpoint in the Trainer: "
                "nothing will be saved before stopping"
            )

    # ------------------------------------------------------------------ per step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._last_batch = (batch, batch_idx)  # a reference, not a copy: for re-running a bad step only
        if self.rerun_on_anomaly:
            self._batch_rng = capture_torch_rng()  # a 5 kB copy: what a re-run of this batch starts from

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # Backward sees the micro-batch's loss divided by the accumulation (automatic optimization) and, under fp16
        # AMP, multiplied by the GradScaler's scale: both undone here, on the device (no host read).
        loss = loss.detach().float().reshape(1)
        scale = loss_scale(trainer)
        if scale is not None:
            loss = loss / scale
        self._losses.append(loss)  # summed over the step's micro-batches: its mean loss
        accumulated = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        self._local_loss = loss * accumulated  # the micro-batch's own loss: what a re-run of it computes

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step + 1  # the step this update makes
        every = logging_period(self.log_every_n_steps, trainer)
        logging_step = step % every == 0
        per_group = logging_step and bool(self._norms.groups)
        # Replicated (DDP): the sums are already global and ride along unreduced; only the loss is summed.
        # Sharded: everything is summed. Either way, in the step's one exchange (with other callbacks'
        # values, e.g. FaultTolerantCheckpoint's signal flag) and one host read.
        exchange = step_exchange(trainer)
        # Several optimizers step in one batch (manual optimization): each exchanges under names of its own.
        index = self._optimizer_index(trainer, optimizer)
        slot = f"{_SLOT}{index}." if index else _SLOT
        local = Packed()
        summed = local if self._norms.replicated else None
        grad_sq, grad_groups, device = self._norms.gradient_sums(per_group, pl_module.device)
        carried = self._sharding.gradient_scale()
        if carried is not None:  # DeepSpeed fp16: its gradients are still scaled (a host float: no device read)
            grad_sq, grad_groups = grad_sq / carried**2, grad_groups / carried**2
        slots = {"grad_sq": grad_sq, "grad_groups": grad_groups if per_group else None}
        if logging_step and self.param_norms:
            param_sq, param_groups = self._norms.parameter_sums(per_group, device)
            slots.update(param_sq=param_sq, param_groups=param_groups if per_group else None)
        for name, value in slots.items():
            if value is not None:
                if summed is not None:
                    summed.add(f"{slot}{name}", value)
                else:
                    exchange.put(trainer, f"{slot}{name}", value)
        loss = (torch.cat(self._losses).sum() if self._losses else torch.zeros(())).to(device) / trainer.world_size
        self._losses.clear()
        # Summed here, after backward, not while it runs: a collective issued in on_before_backward sits in the
        # process group's queue ahead of DDP's bucket all-reduces and stalls them (measured: +1.4% vs +0.1%).
        exchange.put(trainer, f"{slot}loss", loss)
        exchanged = exchange.flush(trainer, local)
        values = {name.removeprefix(slot): value for name, value in exchanged.items() if name.startswith(slot)}
        if logging_step and self.update_ratios:
            # Snapshot this rank's parameter pieces; compared after the optimizer step in on_train_batch_end.
            self._before_update = self._norms.snapshot_parameters()
        self._act(trainer, pl_module, optimizer, values, logging_step, step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._before_update is None:
            return
        before, self._before_update = self._before_update, None
        metrics = self._norms.update_ratios(before, trainer.world_size, pl_module.device)  # logging steps only
        self.last_metrics = {**self.last_metrics, **metrics}
        log_metrics(trainer, metrics)

    # ------------------------------------------------------------------ decisions

    def _fp16_scale(self, trainer: pl.Trainer) -> float | None:
        """The fp16 loss scale this step ran at: AMP's GradScaler's (one host read), or DeepSpeed's engine's."""
        scale = loss_scale(trainer)
        return float(scale) if scale is not None else self._sharding.gradient_scale()

    def _act(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Any,
        values: dict[str, list[float]],
        logging_step: bool,
        step: int,
    ) -> None:
        grad_sq = values["grad_sq"][0]
        total = math.sqrt(grad_sq) if grad_sq >= 0 else float("nan")
        loss = values["loss"][0]
        blow_up = ""
        scale = self._fp16_scale(trainer) if not math.isfinite(total) and math.isfinite(loss) else None
        if scale is not None:
            # fp16: the loss scaler (AMP's GradScaler, DeepSpeed's engine) skips this update and lowers its scale,
            # as it does in any healthy run, unless it overflowed at the floor already.
            self.scaler_skipped_steps += 1
            blow_up = self.scale_floor.overflowed(scale) or ""
            if not blow_up:
                return
        if not math.isfinite(total) or not math.isfinite(loss):
            self.nonfinite_events += 1
            culprits, rerun = self._diagnose(trainer, pl_module, "nonfinite")
            # Born in backward when no forward went non-finite: name the modules whose gradients are not.
            bad_gradients = [] if culprits else self._norms.nonfinite_gradient_modules()
            report = nonfinite_report(step, total, loss, culprits, trainer.global_rank, bad_gradients)
            self._log_rerun(trainer)
            self._take(self.on_nonfinite, (f"{blow_up}\n" if blow_up else "") + report + rerun, optimizer)
            return
        self.scale_floor.stepped()
        spike = self.spikes_of(trainer, optimizer).observe(loss, total)
        if spike:
            _, rerun = self._diagnose(trainer, pl_module, "spike") if self.rerun_on_anomaly else ({}, "")
            if not logging_step:  # on a logging step it goes out with the step's norms, in one row
                self._log_rerun(trainer)
            self._take(self.on_spike, f"step {step}: {spike}{rerun}", optimizer)
        if logging_step:
            param_total = math.sqrt(values["param_sq"][0]) if "param_sq" in values else None
            self._log(trainer, total, values.get("grad_groups", []), param_total, values.get("param_groups", []))

    def _diagnose(self, trainer: pl.Trainer, pl_module: pl.LightningModule, kind: str) -> tuple[dict[int, str], str]:
        """Each rank's first module with a non-finite output, and the re-run's verdict, in one all-reduce.

        Every rank re-runs its last micro-batch; all ranks reach this, because the decision to call it was
        collective (and a sharded forward needs every rank). Returns the culprits and a report line.
        """
        world, rank = trainer.world_size, trainer.global_rank
        slots = torch.zeros(4 * world, device=pl_module.device)  # per rank: culprit, loss, re-run loss, grads
        modules: list[str] = []
        # A pipeline rank holds a stage, not the model: a re-run of the step's forward cannot run on it.
        batch = self._last_batch if pipeline_of(trainer.strategy) is None else None
        rerun: Rerun | None = None
        locate = kind == "nonfinite" and self.locate_nonfinite
        classify_it = self.rerun_on_anomaly and self._batch_rng is not None
        if batch is not None and (locate or classify_it):
            # One re-run serves both: from the RNG state the batch started with (the same dropout masks).
            result = rerun_step(
                pl_module,
                *batch,
                self._batch_rng,
                with_backward=classify_it and self._norms.replicated,
                locate=locate,
            )
            if locate:
                slots[rank], modules = float(result.first_nonfinite), list(result.modules)
            if classify_it:
                rerun = result
                slots[world + rank] = self._local_loss.sum() if self._local_loss is not None else float("nan")
                slots[2 * world + rank] = result.loss
                slots[3 * world + rank] = {None: -1.0, True: 1.0, False: 0.0}[result.gradients_finite]
        if world > 1:
            dist.all_reduce(slots)
        values = slots.tolist()
        if not modules:  # every rank holds the same model: the names are the same everywhere
            modules = [name for name, _ in pl_module.named_modules() if name]
        names = [name.removeprefix(self._norms.prefix) for name in modules]
        culprits = {r: names[int(index) - 1] for r, index in enumerate(values[:world]) if index > 0}
        if rerun is None:
            return culprits, ""
        hosts = _hostnames(world)
        finite = [{-1.0: None, 1.0: True, 0.0: False}.get(v) for v in values[3 * world :]]
        self.last_rerun, explanation = classify(
            kind, values[world : 2 * world], values[2 * world : 3 * world], finite, hosts
        )
        self._rerun_metrics = {"grad_norm/rerun_transient": float(self.last_rerun == "transient")}
        return culprits, f"\n  rerun (same micro-batch, same RNG state): {explanation}"

    def _take(self, action: Action, report: str, optimizer: Any) -> None:
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
        # Every rank raises here, at the same step: FaultTolerantCheckpoint may save collectively on it.
        raise NonFiniteGradientError(
            f"GradNormMonitor stopped training: {report}", checkpoint_first=action == "checkpoint_and_stop"
        )

    def _log(
        self,
        trainer: pl.Trainer,
        total: float,
        groups: list[float],
        param_total: float | None,
        param_groups: list[float],
    ) -> None:
        metrics = self._norms.metrics("grad_norm", total, groups)
        clip = trainer.gradient_clip_val
        if clip and (trainer.gradient_clip_algorithm or "norm") == "norm":
            metrics["grad_norm/total_clipped"] = total * min(1.0, float(clip) / (total + 1e-6))
        if param_total is not None:
            metrics.update(self._norms.metrics("param_norm", param_total, param_groups))
        metrics.update(self._rerun_metrics)
        self._rerun_metrics = {}
        self.last_metrics = metrics
        log_metrics(trainer, metrics)  # in Lightning's row of this batch

    def _log_rerun(self, trainer: pl.Trainer) -> None:
        """Log the last re-run's classification now (a step whose norms are not logged)."""
        metrics, self._rerun_metrics = self._rerun_metrics, {}
        log_metrics(trainer, metrics)  # in Lightning's row of this batch

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._injected:
            handle.remove()
        self._injected = []

    # ------------------------------------------------------------------ state

    @override
    def state_dict(self) -> dict[str, Any]:
        spikes = self.spikes.state_dict()
        return {
            "loss_history": spikes["loss_history"],
            "norm_history": spikes["norm_history"],
            "nonfinite_events": self.nonfinite_events,
            "spike_events": spikes["events"],
            "skipped_steps": self.skipped_steps,
            "other_optimizers_spikes": [detector.state_dict() for detector in self._other_spikes],
            "scaler_skipped_in_a_row": self.scale_floor.skipped_in_a_row,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.spikes.load_state_dict({**state_dict, "events": state_dict.get("spike_events", 0)})
        self._other_spikes = []
        for state in state_dict.get("other_optimizers_spikes", []):  # absent in older checkpoints
            detector = SpikeDetector(self.spikes.window, self.spikes.threshold, self.spikes.min_history)
            detector.load_state_dict(state)
            self._other_spikes.append(detector)
        self.nonfinite_events = state_dict.get("nonfinite_events", 0)
        self.skipped_steps = state_dict.get("skipped_steps", 0)
        self.scale_floor.skipped_in_a_row = state_dict.get("scaler_skipped_in_a_row", 0)


def _hostnames(world: int) -> list[str]:
    """Every rank's host name (an anomaly only: one small gather)."""
    import socket

    hosts: list[Any] = [socket.gethostname()] * world
    if world > 1:
        dist.all_gather_object(hosts, socket.gethostname())
    return [str(host) for host in hosts]
