"""Models and data a test names by class path: a third party's LightningModule, slow or faulty shapes.

They live at module level so that every rank (a fresh process) can build them from a class path.

Example::

    run_cli(["fit", "--model=tests.support.models.ThirdPartyLM", "--trainer.max_steps=3"], cwd=tmp_path)
"""

from __future__ import annotations

import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_mlopt.demos import TokenDataModule


class SleepyGPT(pl.LightningModule):
    """The GPT demo, except that one rank naps inside ``training_step`` at one step (a hang to detect).

    Args:
        sleep_rank: the rank that naps.
        sleep_step: the global step at which it naps.
        sleep_seconds: how long.
        only_first_attempt: nap only when torchrun's TORCHELASTIC_RESTART_COUNT is 0 (a hang that a
            restart cures).
    """

    def __init__(
        self, sleep_rank: int = 1, sleep_step: int = 3, sleep_seconds: float = 300.0, only_first_attempt: bool = False
    ) -> None:
        super().__init__()
        from lightning_mlopt.demos import GPTLanguageModel

        self.inner = GPTLanguageModel()
        self.sleep_rank, self.sleep_step, self.sleep_seconds = sleep_rank, sleep_step, sleep_seconds
        self.only_first_attempt = only_first_attempt

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        here_and_now = self.global_rank == self.sleep_rank and self.global_step == self.sleep_step
        if here_and_now and (first_attempt or not self.only_first_attempt):
            nap_inside_training_step(self.sleep_seconds)
        return self.inner._loss(batch)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def nap_inside_training_step(seconds: float) -> None:
    """The function a hang dump must name."""
    import time

    time.sleep(seconds)


class ThirdPartyLM(pl.LightningModule):
    """A language model as a user brings one, written the way Hugging Face's GPT-2 and Lightning's own examples
    are, not like our demos: hyperparameters saved with ``save_hyperparameters()``, its own dataloaders (no
    datamodule), ``nn.TransformerEncoder`` with a causal mask, metrics named ``train_loss``/``val_loss``.

    Args:
        vocab_size, n_positions, n_embd, n_layer, n_head, dropout: the model's size.
        batch_size: per process.
        num_sequences: synthetic sequences (a seeded Markov chain of tokens) in the training set.
        lr: AdamW's learning rate.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        n_positions: int = 32,
        n_embd: int = 32,
        n_layer: int = 2,
        n_head: int = 2,
        dropout: float = 0.1,
        batch_size: int = 8,
        num_sequences: int = 256,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = torch.nn.Embedding(vocab_size, n_embd)
        self.wpe = torch.nn.Embedding(n_positions, n_embd)
        layer = torch.nn.TransformerEncoderLayer(n_embd, n_head, 4 * n_embd, dropout, batch_first=True)
        self.h = torch.nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.lm_head = torch.nn.Linear(n_embd, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1], device=input_ids.device)
        hidden = self.h(self.wte(input_ids) + self.wpe(positions), mask=mask, is_causal=True)
        return self.lm_head(hidden)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def _tokens(self, count: int, seed: int) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(seed)
        steps = torch.randint(1, 4, (count, self.hparams.n_positions), generator=generator)
        data = steps.cumsum(dim=1) % self.hparams.vocab_size  # learnable: each token follows from the last
        return torch.utils.data.DataLoader(data, batch_size=self.hparams.batch_size, shuffle=seed == 0)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._tokens(self.hparams.num_sequences, seed=0)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._tokens(64, seed=1)

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self._tokens(64, seed=2)

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        return self._tokens(16, seed=3)


class _SleepingCollate:
    """The default collate, sleeping first on the chosen ranks (picklable, for DataLoader workers)."""

    def __init__(self, seconds: float, ranks: list[int] | None) -> None:
        self.seconds, self.ranks = seconds, ranks

    def __call__(self, samples):  # type: ignore[no-untyped-def]
        import torch.distributed as dist
        from torch.utils.data import default_collate

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if self.ranks is None or rank in self.ranks:
            time.sleep(self.seconds)
        return default_collate(samples)


class SlowCollateTokens(TokenDataModule):
    """The GPT demo's token data with a collate that sleeps ``collate_sleep_s`` on ``slow_ranks`` (None: all)."""

    def __init__(self, collate_sleep_s: float = 0.05, slow_ranks: list[int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.collate = _SleepingCollate(collate_sleep_s, slow_ranks)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=self.collate
        )


class NaNSampleRegression(pl.LightningModule):
    """A linear regression whose training data holds one sample with a NaN feature (a bad sample in the data)."""

    def __init__(self, bad_index: int = 5, samples: int = 64) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        generator = torch.Generator().manual_seed(0)
        features = torch.randn(samples, 8, generator=generator)
        features[bad_index, 3] = float("nan")
        self.data = torch.utils.data.TensorDataset(features, torch.randn(samples, 1, generator=generator))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        features, targets = batch
        return torch.nn.functional.mse_loss(self.layer(features), targets)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4, shuffle=True)


class StrayCollectiveGPT(pl.LightningModule):
    """The GPT demo, except that one rank issues a collective the others do not, at one step.

    Args:
        kind: ``sync_dist`` (``self.log(..., sync_dist=True)`` inside a rank's branch: a barrier and an
            all-reduce), ``all_gather`` (``self.all_gather`` of a metric on one rank), or ``shape`` (every rank
            all-reduces a metric, but ``stray_rank``'s has another shape: the collectives pair up and the step
            ends, wrong).
        stray_rank: the rank that issues it.
        stray_step: the global step at which it does.
    """

    def __init__(self, kind: str = "sync_dist", stray_rank: int = 0, stray_step: int = 2) -> None:
        super().__init__()
        from lightning_mlopt.demos import GPTLanguageModel

        self.inner = GPTLanguageModel()
        self.kind, self.stray_rank, self.stray_step = kind, stray_rank, stray_step

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self.inner._loss(batch)
        if self.global_rank == self.stray_rank and self.global_step == self.stray_step:
            if self.kind == "sync_dist":
                self.log("train/stray_loss", loss, sync_dist=True)  # the stray collective: rank-0-only sync
            elif self.kind == "all_gather":
                self.all_gather(torch.ones(4))  # the stray collective: a metric gathered on one rank
        if self.kind == "shape" and self.global_step == self.stray_step:
            shape = (2, 2) if self.global_rank == self.stray_rank else (4,)
            torch.distributed.all_reduce(torch.ones(shape))  # the same bytes on every rank: they pair up
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=3e-4)
