"""Every logger row of a batch carries one step label, ours and Lightning's, across a resume.

Lightning labels a batch's row with the batches that stepped before it; a callback row labelled with
``global_step`` (already counting the update) landed one step later: at a resume step MLflow dropped a row and
W&B showed two. In-process Trainers with a recording logger: the labels themselves are what is tested.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers.logger import Logger

from lightning_mlopt.callbacks import GradNormMonitor, PerformanceMonitor


class _Rows(Logger):
    """Keeps each ``log_metrics`` call as (step, keys), shared by every launch of a run."""

    def __init__(self, rows: list[tuple[int, set[str]]]) -> None:
        super().__init__()
        self.rows = rows

    @property
    def name(self) -> str:
        return "rows"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        assert step is not None
        self.rows.append((step, set(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class _LoggingModel(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"])
        return out


def _fit(tmp_path: Path, rows: list, max_steps: int, ckpt_path: str | None = None) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        log_every_n_steps=1,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        logger=_Rows(rows),
        callbacks=[GradNormMonitor(log_every_n_steps=1), PerformanceMonitor(log_every_n_steps=1, count_flops=False)],
    )
    trainer.fit(_LoggingModel(), ckpt_path=ckpt_path)
    return trainer


def _labels(rows: list[tuple[int, set[str]]], key: str) -> list[int]:
    return [step for step, keys in rows if key in keys]


def test_our_rows_and_lightnings_share_each_batchs_label_across_a_resume(tmp_path):
    rows: list[tuple[int, set[str]]] = []
    first = _fit(tmp_path, rows, max_steps=4)
    first.save_checkpoint(tmp_path / "step4.ckpt")  # the launch is killed here; the next resumes
    _fit(tmp_path, rows, max_steps=8, ckpt_path=str(tmp_path / "step4.ckpt"))
    lightning = _labels(rows, "train/loss")
    assert lightning == list(range(8)), rows  # Lightning's own labels: 0..7, each once
    assert _labels(rows, "grad_norm/total") == lightning, "every batch's norm in that batch's row, once"
    perf = _labels(rows, "perf/frac_forward")
    assert perf and set(perf) <= set(lightning), rows
    assert max(Counter(perf).values()) == 1, "no label twice"
