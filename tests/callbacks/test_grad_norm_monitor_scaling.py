"""GradNormMonitor where the loss is not one number per step: several optimizers, and fp16's loss scaler.

In-process Trainers on CPU. Manual optimization with two optimizers keeps two spike histories; fp16 AMP (torch's
CPU GradScaler) overflows that go on down to the floor are reported as a blow-up, not counted as the scaler's.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_mlopt.callbacks import GradNormMonitor
from lightning_mlopt.exceptions import NonFiniteGradientError

JUMP_AT = 30  # the batch whose small loss jumps 50-fold: a spike against its own optimizer's history only


class _TwoOptimizers(pl.LightningModule):
    """A small loss (around 1) and a large one (around 1000), each with its own optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.small, self.large = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        small_opt, large_opt = self.optimizers()  # type: ignore[misc]
        small = torch.nn.functional.mse_loss(self.small(x), y) + 1.0
        self.manual_backward(small * (50.0 if batch_idx == JUMP_AT else 1.0))
        small_opt.step()
        small_opt.zero_grad()
        large = 1000.0 * (torch.nn.functional.mse_loss(self.large(x), y) + 1.0)
        self.manual_backward(large)
        large_opt.step()
        large_opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.small.parameters(), lr=1e-4), torch.optim.SGD(self.large.parameters(), lr=1e-7)

    def train_dataloader(self) -> Any:
        x = torch.full((40, 4), 0.5)  # one sample, again and again: each loss falls slowly and smoothly
        return torch.utils.data.DataLoader(list(zip(x, torch.full((40, 1), 0.5), strict=True)), batch_size=1)


def _fit(module: pl.LightningModule, monitor: GradNormMonitor, max_steps: int, **trainer: Any) -> pl.Trainer:
    pl.seed_everything(0)
    fitting = pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False, limit_val_batches=0,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[monitor], **trainer,
    )  # fmt: skip
    fitting.fit(module)
    return fitting


def test_each_optimizer_judges_its_losses_against_its_own_history(recwarn):
    # One mixed history (means near 500, deviations near 500) would hide the small loss's 50-fold jump.
    monitor = GradNormMonitor(spike_min_history=5, rerun_on_anomaly=False)
    _fit(_TwoOptimizers(), monitor, max_steps=2 * 40)  # two optimizer steps per batch
    said = [str(w.message) for w in recwarn if "spike" in str(w.message)]
    assert monitor.spike_events == 1 and len(said) == 1, said
    small, large = monitor.loss_history, monitor.spikes_of(_Optimizers(), "large").loss_history
    assert len(small) == 39 and max(small) < 10, "the small optimizer's history: its own losses, the jump kept out"
    assert len(large) == 40 and min(large) > 500, "the large optimizer's history: its own losses only"
    state = monitor.state_dict()
    resumed = GradNormMonitor(spike_min_history=5)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state, "both histories survive a resume"


class _Optimizers:
    """A stand-in Trainer whose second optimizer is ``"large"``: reads the monitor's second history."""

    optimizers = ["small", "large"]


class _Overflowing(pl.LightningModule):
    """Every gradient overflows, whatever the loss scale: a blow-up, not fp16's range."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.net.weight.register_hook(lambda grad: grad * float("inf"))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        x = torch.rand(64, 4)
        return torch.utils.data.DataLoader(list(zip(x, x.sum(dim=1, keepdim=True), strict=True)), batch_size=4)


def test_fp16_overflows_down_to_the_scale_floor_are_reported_as_a_blow_up():
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)  # 16, 8, 4, 2, then 1: the floor
    monitor = GradNormMonitor(rerun_on_anomaly=False, locate_nonfinite=False)
    with pytest.raises(NonFiniteGradientError, match=r"overflowed at a loss scale of 1, at or below min_loss_scale"):
        _fit(_Overflowing(), monitor, max_steps=16, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert monitor.scaler_skipped_steps == 5 and monitor.nonfinite_events == 1
    assert monitor.scale_floor.skipped_in_a_row == 5


def test_without_a_floor_every_overflow_stays_the_scalers():
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    monitor = GradNormMonitor(rerun_on_anomaly=False, min_loss_scale=None)
    _fit(_Overflowing(), monitor, max_steps=8, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert monitor.scaler_skipped_steps == 8 and monitor.nonfinite_events == 0
