"""Continuing a finished run that stopped mid-epoch (``max_steps`` inside an epoch) trains on the right samples.

The final checkpoint is written after Lightning has counted the cut epoch complete: it used to record "epoch 1,
S samples", and ``resume.final`` then skipped S samples of epoch 1, never saw the rest of epoch 0, and left the
uninterrupted curve at the first resumed step (issue 58).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_mlopt.callbacks import FaultTolerantCheckpoint, Resume

EPOCH_BATCHES = 8


class _Indexed(Dataset):
    """Sample i is (i, features of i): the model records which samples it trained on."""

    def __len__(self) -> int:
        return 4 * EPOCH_BATCHES

    def __getitem__(self, index: int) -> tuple[int, Tensor]:
        return index, torch.randn(8, generator=torch.Generator().manual_seed(index))


class _Recording(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.seen: list[list[int]] = []
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        indices, features = batch
        self.seen.append(indices.tolist())
        loss = self.layer(features).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Indexed(), batch_size=4, shuffle=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(root: Path, max_steps: int, resume: Resume | None = None) -> _Recording:
    pl.seed_everything(1234)
    model = _Recording()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
        callbacks=[FaultTolerantCheckpoint(dirpath=str(root / "checkpoints"), resume=resume or Resume())],
    )  # fmt: skip
    trainer.fit(model)
    return model


def test_a_finished_run_continued_from_mid_epoch_trains_on_the_samples_the_uninterrupted_run_does(tmp_path):
    uninterrupted = _fit(tmp_path / "reference", max_steps=EPOCH_BATCHES + 4)

    first = _fit(tmp_path / "run", max_steps=5)  # stops with 3 batches of epoch 0 unused
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step-000000005" / "state.ckpt", weights_only=False)
    assert saved["data_position"]["epoch"] == 0 and saved["data_position"]["batches_per_rank"] == 5
    assert saved["epoch"] == 0

    continued = _fit(tmp_path / "run", max_steps=EPOCH_BATCHES + 4, resume=Resume(final=True))
    assert first.seen + continued.seen == uninterrupted.seen
    assert first.losses + continued.losses == uninterrupted.losses
    for mine, theirs in zip(continued.parameters(), uninterrupted.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_finished_run_stopped_at_an_epochs_end_continues_with_the_next_epoch(tmp_path):
    uninterrupted = _fit(tmp_path / "reference", max_steps=EPOCH_BATCHES + 2)
    first = _fit(tmp_path / "run", max_steps=EPOCH_BATCHES)
    continued = _fit(tmp_path / "run", max_steps=EPOCH_BATCHES + 2, resume=Resume(final=True))
    assert first.seen + continued.seen == uninterrupted.seen
    assert first.losses + continued.losses == uninterrupted.losses
