"""FaultTolerantCheckpoint: sync save time, async stall, resume time, and throughput against the raw disk.

    python benchmarks/checkpoint/bench.py            # ~420 MB of state, 3 saves per mode
    python benchmarks/checkpoint/bench.py --width 1024 --layers 4

A model of ``layers`` Linear(width, width) layers with AdamW (parameters + two moments: 12 bytes per
parameter of state) trains through the real Trainer on one CPU process. Measured in the same run:

- sync save: the time a save blocks training with ``async_save: false`` (write streamed through the
  checksum, fsync, manifest, commit); goal: its throughput >= 0.8 x the raw write speed;
- async stall: the time a save blocks training with ``async_save: true`` (dump and copy to CPU memory);
  goal: at most 6% of the sync save time;
- verify + load: checking every checksum of the newest checkpoint and loading it (``weights_only``, the
  allowlist), the part of a resume that reads the disk; goal: >= 0.5 x the raw read speed;
- resume: a new fit that verifies the newest checkpoint and loads it, up to its first step;
- raw disk: writing the same number of bytes with ``write`` and ``fsync``, and reading them back (page
  cache warm, as the checkpoint's own read is); save and load throughput are reported as ratios to them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import median, write_result


def _model(width: int, layers: int) -> Any:
    import lightning.pytorch as pl
    import torch

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.layers(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Wide()


def _loader(width: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.randn(512, width)), batch_size=4)


def _fit(root: Path, width: int, layers: int, steps: int, every: int, async_save: bool) -> tuple[list[float], float]:
    """Train; return the seconds each save blocked the training loop, and the time to the first step."""
    import lightning.pytorch as pl

    from lightning_mlopt.callbacks import FaultTolerantCheckpoint

    class Timed(FaultTolerantCheckpoint):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.blocked: list[float] = []
            self.first_step_at = 0.0

        def _save(self, *args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            super()._save(*args, **kwargs)
            self.blocked.append(time.perf_counter() - start)

        def on_train_batch_start(self, *args: Any) -> None:
            super().on_train_batch_start(*args)
            if not self.first_step_at:
                self.first_step_at = time.perf_counter()

    callback = Timed(
        dirpath=str(root), every_n_steps=every, async_save=async_save, save_on_train_end=False, keep_last=2
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    start = time.perf_counter()
    trainer.fit(_model(width, layers), _loader(width))
    callback._writer.wait()
    return callback.blocked, callback.first_step_at - start


def _raw_write_seconds(path: Path, size: int) -> float:
    payload = os.urandom(min(size, 64 * 2**20))
    start = time.perf_counter()
    with path.open("wb") as handle:
        written = 0
        while written < size:
            chunk = payload[: size - written]
            handle.write(chunk)
            written += len(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def _raw_read_seconds(folder: Path) -> float:
    start = time.perf_counter()
    buffer = bytearray(8 * 2**20)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with path.open("rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
    return time.perf_counter() - start


def _verify_and_load_seconds(folder: Path) -> float:
    from lightning_mlopt.checkpoint import verify
    from lightning_mlopt.checkpoint.serialization import load_file

    start = time.perf_counter()
    verify(folder)
    load_file(folder / "state.ckpt")
    for rng in (folder / "rng").glob("*.pt"):
        load_file(rng)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    steps = args.every * args.saves
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent) as scratch:
        root = Path(scratch)
        sync_blocked, _ = _fit(root / "sync", args.width, args.layers, steps, args.every, async_save=False)
        async_blocked, _ = _fit(root / "async", args.width, args.layers, steps, args.every, async_save=True)
        newest = max((root / "sync").glob("step-*"))
        size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
        raw = median([_raw_write_seconds(root / f"raw{i}", size) for i in range(3)])
        raw_read = median([_raw_read_seconds(newest) for _ in range(3)])
        verify_load = median([_verify_and_load_seconds(newest) for _ in range(3)])
        # Resume: the same fit again auto-resumes from the newest sync checkpoint and trains one more step.
        resume = []
        for _ in range(2):
            _, to_first_step = _fit(root / "sync", args.width, args.layers, steps + 1, 10**9, async_save=False)
            resume.append(to_first_step)
    sync_s, stall_s, resume_s = median(sync_blocked), median(async_blocked), median(resume)
    mb = size / 1e6
    ratio = stall_s / sync_s
    throughput = mb / sync_s
    raw_throughput = mb / raw
    write_ratio = throughput / raw_throughput
    read_ratio = raw_read / verify_load
    body = (
        f"Model: {args.layers} x Linear({args.width}, {args.width}) with AdamW; checkpoint {mb:.0f} MB "
        f"(parameters and two Adam moments, fp32). One CPU process, {args.saves} saves per mode, medians.\n\n"
        "| measure | seconds | note |\n|---|---|---|\n"
        f"| sync save (training blocked) | {sync_s:.2f} | dump + write streamed through xxHash3-128 + fsync + "
        "manifest + rename |\n"
        f"| async stall (training blocked) | {stall_s:.3f} | dump and copy to CPU memory; written in the background |\n"
        f"| verify + load | {verify_load:.2f} | every checksum, then `torch.load(weights_only=True)` |\n"
        f"| resume (fit start to first step) | {resume_s:.2f} | verify checksums + allowlist + load + restore |\n"
        f"| raw write of {mb:.0f} MB + fsync | {raw:.2f} | same disk, same run |\n"
        f"| raw read of the checkpoint | {raw_read:.2f} | same files, page cache warm like the load's |\n\n"
        f"- **Save throughput {throughput:.0f} MB/s = {write_ratio:.2f} x the raw write speed** ({raw_throughput:.0f} "
        f"MB/s; goal >= 0.8: {'met' if write_ratio >= 0.8 else 'NOT met'}).\n"
        f"- **Verify + load = {read_ratio:.2f} x the raw read speed** (goal >= 0.5: "
        f"{'met' if read_ratio >= 0.5 else 'NOT met'}).\n"
        f"- **Async stall / sync save: {ratio:.3f}** (goal <= 0.06: {'met' if ratio <= 0.06 else 'NOT met'}).\n"
    )
    path = write_result("checkpoint", "cpu-1proc", body)
    print(body)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
