"""GradNormMonitor: norms equal a single-process reference under every strategy; NaN located; spikes caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_mlopt.callbacks import GradNormMonitor
from lightning_mlopt.callbacks.grad_norm_monitor import module_group
from lightning_mlopt.demos import GPTLanguageModel
from tests.conftest import MONITORED_STEP, SHARED_RUN_CLIP_VALUE, failure_report
from tests.support.grad_norms import MONITOR, assert_norms_match_one_process


def _record(out: Path) -> tuple[str, ...]:
    return ("--trainer.callbacks+=tests.support.recorders.RecordMonitor", f"--trainer.callbacks.out_dir={out}")


# Read from the session's shared runs, which log the monitor at every step (tests/support/grad_norms.py); the TP
# layouts' case is in tests/strategies/test_tensor_parallel.py, on its module's runs.
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_global_norm_equals_the_unsharded_reference(strategy, strategy_runs):
    out = strategy_runs[strategy].run_dir.parents[1] / strategy
    assert_norms_match_one_process(out, step=MONITORED_STEP, clip=SHARED_RUN_CLIP_VALUE, ranks=2)


def _nan_run(tmp_path: Path, action: str, extra: tuple[str, ...] = ()):
    from tests.conftest import run_cli
    from tests.support.cli_args import fit_args

    out = tmp_path / "monitor"
    return run_cli(
        fit_args(
            "--trainer.limit_val_batches=0",
            "--trainer.callbacks+=lightning_mlopt.callbacks.GradNormMonitor",
            f"--trainer.callbacks.on_nonfinite={action}",
            "--trainer.callbacks+=tests.support.faults.InjectNonFinite",
            "--trainer.callbacks.module=model.layers.1.mlp.0",
            "--trainer.callbacks.step=3",
            "--trainer.callbacks.ranks=[1]",
            *_record(out),
            "--trainer.callbacks+=tests.support.recorders.RecordEverything",
            f"--trainer.callbacks.out_dir={tmp_path / 'record'}",
            *extra,
            strategy="ddp",
            steps=6,
            run_dir=tmp_path / "run",
        ),
        cwd=tmp_path,
        preloaded=True,
    )


@pytest.mark.multiprocess
def test_nan_on_one_rank_is_located_and_stop_exits_with_the_diagnosis(tmp_path):
    result = _nan_run(tmp_path, "stop")
    assert result.returncode != 0
    assert "NonFiniteGradientError" in result.stderr
    assert "non-finite values at step 4" in result.stderr
    assert "rank 1: first non-finite output in forward order: layers.1.mlp.0" in result.stderr
    assert "rank 0: first" not in result.stderr
    # Every rank raised; rank zero alone wrote the exception checkpoint (both once wrote and committed the same
    # folder: a manifest covering one rank's files and a stray .manifest.json.tmp).
    from lightning_mlopt.checkpoint import CheckpointStore

    entry = CheckpointStore(tmp_path / "run" / "checkpoints").newest_valid()
    assert entry is not None and entry.manifest.reason == "exception" and entry.step == 3
    on_disk = {str(p.relative_to(entry.path)) for p in entry.path.rglob("*") if p.is_file()}
    assert on_disk == {*entry.manifest.files, "manifest.json"}
    assert {name for name in on_disk if name.startswith("rng/")} == {"rng/rank-0.pt"}


@pytest.mark.multiprocess
def test_skip_drops_the_step_and_leaves_finite_weights(tmp_path):
    result = _nan_run(tmp_path, "skip")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipping this optimizer step" in result.stderr
    params = torch.load(tmp_path / "record" / "params.pt")
    assert all(torch.isfinite(value).all() for value in params.values())
    record = json.loads((tmp_path / "monitor" / "monitor-rank0.json").read_text())
    assert record["state"]["skipped_steps"] == 1 and record["state"]["nonfinite_events"] == 1
    # FaultTolerantCheckpoint's per-step vote rode in the monitor's exchange: one collective per batch, not two,
    # and UnevenInputs' comparison of the ranks' batch counts at the epoch's start (equal: nothing per batch).
    assert record["exchanges"] - 1 == record["batches"] == 6


@pytest.mark.multiprocess
def test_checkpoint_and_stop_saves_the_state_before_the_bad_update(tmp_path):
    from lightning_mlopt.checkpoint import CheckpointStore

    result = _nan_run(tmp_path, "checkpoint_and_stop", extra=("--checkpoint.save_on.exception=false",))
    assert result.returncode != 0
    assert "saved a checkpoint at step 3" in result.stderr
    entry = CheckpointStore(tmp_path / "run" / "checkpoints").newest_valid()
    assert entry is not None and entry.step == 3 and entry.manifest.reason == "nonfinite"


@pytest.mark.multiprocess
def test_warn_reports_and_keeps_training(tmp_path):
    result = _nan_run(tmp_path, "warn")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 1: first non-finite output in forward order: layers.1.mlp.0" in result.stderr


def _spike_run(tmp_path: Path, **monitor: object) -> tuple[object, GradNormMonitor]:
    import lightning.pytorch as pl

    from lightning_mlopt.demos import TokenDataModule
    from tests.support.faults import InjectNonFinite

    pl.seed_everything(0)
    callback = GradNormMonitor(log_every_n_steps=1, spike_min_history=5, **monitor)  # type: ignore[arg-type]
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=12,
        logger=pl.loggers.CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[callback, InjectNonFinite("model.lm_head", step=10, factor=30.0)],
    )
    trainer.fit(GPTLanguageModel(n_layer=2), TokenDataModule(num_sequences=256, batch_size=8))
    return trainer, callback


@pytest.mark.slow
def test_loss_spike_is_caught_and_logged_through_the_logger(tmp_path):
    trainer, monitor = _spike_run(tmp_path)
    assert monitor.spike_events >= 1
    metrics = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    assert {"grad_norm/total", "grad_norm/layers.0", "grad_norm/lm_head", "step"} <= set(header)
    assert len(metrics) == 1 + 12  # one row per step


@pytest.mark.slow  # a 12-step fit: 2.4 s with the other worker training, over 6 s on a loaded run
def test_spike_stop_raises_with_the_statistics(tmp_path):
    from lightning_mlopt.callbacks import NonFiniteGradientError

    with pytest.raises(NonFiniteGradientError, match=r"step 11: loss spike: .* standard deviations above"):
        _spike_run(tmp_path, on_spike="stop")


def test_state_survives_save_and_resume():
    first = GradNormMonitor(spike_window=4, spike_min_history=3)
    first.loss_history.extend([1.0, 2.0, 3.0, 4.0, 5.0])
    first.spike_events, first.skipped_steps = 2, 1
    second = GradNormMonitor(spike_window=4, spike_min_history=3)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert list(second.loss_history) == [2.0, 3.0, 4.0, 5.0]
    assert (second.spike_events, second.skipped_steps) == (2, 1)
    assert GradNormMonitor().state_key != GradNormMonitor(depth=3).state_key
    second.load_state_dict({})  # an older checkpoint without our state still loads


def test_module_grouping_and_validation():
    assert module_group("layers.3.attn.qkv.weight", 2) == "layers.3"
    assert module_group("layers.3.attn.qkv.weight", 3) == "layers.3.attn"
    assert module_group("lm_head.weight", 2) == "lm_head"
    with pytest.raises(ValueError, match="on_nonfinite must be"):
        GradNormMonitor(on_nonfinite="explode")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spike_window must be >= 2"):
        GradNormMonitor(spike_window=1)


class _OneHugeTarget(torch.utils.data.Dataset):
    """Regression pairs; sample 44's target is far off: a spike that every re-run of its batch reproduces."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), index / 64)
        return x, torch.tensor([1e3 if index == 44 else x.sum().item()])


def _regression(precision_plugins: list, accumulate: int, monitor: GradNormMonitor):  # type: ignore[no-untyped-def]
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            return torch.utils.data.DataLoader(_OneHugeTarget(), batch_size=4)

    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=64 // 4 // accumulate, accumulate_grad_batches=accumulate, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        plugins=precision_plugins, callbacks=[monitor],
    )  # fmt: skip
    trainer.fit(Regression())
    return trainer


def test_a_reproducible_spike_under_gradient_accumulation_is_not_blamed_on_the_hardware(recwarn):
    # The spike sits in the step's last micro-batch (batch 11 of 2-batch steps), the one a re-run repeats; the
    # re-run's loss is the micro-batch's own, which backward saw divided by the accumulation.
    monitor = GradNormMonitor(spike_min_history=3, on_spike="warn")
    _regression([], accumulate=2, monitor=monitor)
    said = [str(w.message) for w in recwarn if "loss spike" in str(w.message)]
    assert monitor.spike_events >= 1 and said, [str(w.message) for w in recwarn]
    assert "reproducible" in said[0] and "suspect the hardware" not in said[0], said[0]


def test_fp16_amp_overflow_steps_are_the_scalers_and_losses_are_unscaled():
    # fp16 AMP on CPU (Lightning's MixedPrecision with torch's CPU GradScaler): the scaler starts at 65536 and
    # overflows in the first steps, skipping them, as on a GPU. The monitor used to stop the run at step 1.
    from lightning.pytorch.plugins import MixedPrecision

    monitor = GradNormMonitor(spike_min_history=3)
    trainer = _regression([MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))], 1, monitor)
    assert trainer.global_step == 16 and monitor.nonfinite_events == 0
    assert monitor.scaler_skipped_steps >= 1 and float(trainer.precision_plugin.scaler.get_scale()) < 65536
    assert max(monitor.loss_history) < 1e5, "the losses are the model's, not multiplied by the scale"


DEEPSPEED_FP16_FROM_2_20 = '{"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 20, "hysteresis": 1}}'
"""DeepSpeed's fp16 block with a first loss scale of 2^20 (its first steps overflow) and halving on each overflow."""


def _deepspeed_fp16_run(tmp_path: Path, out: Path, devices: int, *monitor: str):  # type: ignore[no-untyped-def]
    """8 steps of ZeRO-2 in fp16 from a first loss scale of 2^20 (its first steps overflow), GradNormMonitor at
    every step with ``monitor`` settings, and DeepSpeed's own norm and scale recorded beside it."""
    from tests.conftest import run_cli
    from tests.support.cli_args import fit_args

    args = fit_args(
        "--trainer.limit_val_batches=0",
        "--trainer.precision=16-mixed",
        f"--trainer.strategy.init_args.config={DEEPSPEED_FP16_FROM_2_20}",
        "--trainer.callbacks+=tests.support.faults.DeepSpeedFp16OnCpu",
        *MONITOR,
        *monitor,
        "--trainer.callbacks+=tests.support.recorders.RecordDeepSpeedNorms",
        f"--trainer.callbacks.out_dir={out}",
        strategy="zero2",
        devices=devices,
        steps=8,
        run_dir=tmp_path / "run",
    )
    return run_cli(args, cwd=tmp_path, preloaded=True)


@pytest.mark.multiprocess
def test_under_deepspeed_fp16_overflows_are_the_engines_and_norms_are_unscaled(tmp_path):
    # DeepSpeed scales the loss inside its backward and unscales its gradient partitions inside its step: between
    # the two, where the monitor reads them, they carry the loss scale (2^16 by default: norms 65536 times too
    # large). A scale too large overflows, and the engine skips the step and halves it, as early steps of fp16 runs
    # do; read as non-finite, such a step stopped the run. A first scale of 2^20 makes the first steps overflow.
    out = tmp_path / "deepspeed"
    result = _deepspeed_fp16_run(tmp_path, out, devices=2)
    assert result.returncode == 0, failure_report(result)
    for rank in (0, 1):
        rows = json.loads((out / f"deepspeed-rank{rank}.json").read_text())
        skipped = monitor_matches_engine(rows, rel=1e-3)
        assert skipped[0] and not all(skipped), f"the first steps overflow at 2^20, later ones do not: {rows}"
        assert rows[-1]["loss_scale"] == 2 ** (20 - sum(skipped))


def monitor_matches_engine(rows: list[dict], rel: float) -> list[bool]:
    """Which steps the engine skipped (``RecordDeepSpeedNorms`` rows), asserting that the monitor counted those
    and only those as the scaler's, and that on every other step its norm is the engine's own, unscaled one."""
    skipped = [row["skipped"] > (rows[i - 1]["skipped"] if i else 0) for i, row in enumerate(rows)]
    assert rows[-1]["scaler_skipped_steps"] == sum(skipped), f"every step the engine skipped, and only those: {rows}"
    for row, was_skipped in zip(rows, skipped, strict=True):
        if not was_skipped:
            assert row["monitor"]["grad_norm/total"] == pytest.approx(row["engine_norm"], rel=rel), row
    return skipped


@pytest.mark.slow
def test_under_deepspeed_fp16_in_one_process_an_overflow_at_the_floor_is_a_blow_up(tmp_path):
    # The engine's scale is the one the floor is held against: with min_loss_scale at the first scale, the first
    # overflow is no longer the scaler's routine but a blow-up, and on_nonfinite (stop) ends the run at step 1.
    result = _deepspeed_fp16_run(tmp_path, tmp_path / "deepspeed", 1, f"--trainer.callbacks.min_loss_scale={2**20}")
    assert result.returncode == 1, failure_report(result)
    said = result.stdout + result.stderr
    floor = "fp16: the update overflowed at a loss scale of 1.04858e+06, at or below min_loss_scale"
    assert floor in said, said[-3000:]
    assert "NonFiniteGradientError" in said and "at step 1 " in said
