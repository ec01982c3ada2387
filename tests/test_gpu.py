"""The same strategies on CUDA with NCCL and bf16 mixed precision (skipped where there is no GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CONFIGS, SMOKE, run_cli


def _fit_on_gpus(tmp_path, overlay: str, *extra: str):  # type: ignore[no-untyped-def]
    """``fit`` of the GPT demo under a strategy overlay on up to 2 GPUs."""
    devices = min(2, torch.cuda.device_count())
    overlay_file = str(CONFIGS / "strategies" / f"{overlay}.yaml")
    return run_cli(
        ["fit", "--config", str(CONFIGS / "gpt.yaml"), "--config", overlay_file, "--trainer.accelerator=gpu",
         f"--trainer.devices={devices}", *extra],
        cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.requires_cuda
@pytest.mark.parametrize("overlay", ["ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload"])
def test_strategy_trains_on_gpus_in_bf16(tmp_path, overlay):
    extra = ["--trainer.strategy.init_args.param_dtype=bfloat16"] if overlay == "fsdp" else []
    result = _fit_on_gpus(tmp_path, overlay, "--trainer.precision=bf16-mixed", *extra, *SMOKE)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("overlay", ["ddp", "fsdp"])
def test_compiled_blocks_train_on_gpus_with_inductors_kernels(tmp_path, overlay):
    # The CPU tests' claim (tests/callbacks/test_compile_model.py) where inductor generates Triton kernels.
    extra = ["--trainer.strategy.init_args.param_dtype=bfloat16"] if overlay == "fsdp" else []
    compiled = ["--config", str(CONFIGS / "features" / "compile.yaml")]
    result = _fit_on_gpus(tmp_path, overlay, "--trainer.precision=bf16-mixed", *extra, *compiled, *SMOKE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.compile (inductor): 4 block region(s)" in result.stdout + result.stderr
    assert "compiled no graph" not in result.stdout + result.stderr


@pytest.mark.requires_cuda
def test_float8_linears_train_under_fsdp_on_gpus_with_float8_all_gather(tmp_path):
    # Native float8 matmuls from compute capability 8.9 (H100, H200); emulated, and said so, before it.
    features = ["--config", str(CONFIGS / "features" / "float8.yaml"), "--float8.fsdp_float8_all_gather=true"]
    bf16 = ["--trainer.precision=bf16-mixed", "--trainer.strategy.init_args.param_dtype=bfloat16"]
    result = _fit_on_gpus(tmp_path, "fsdp", *bf16, *features, *SMOKE)
    assert result.returncode == 0, result.stderr[-3000:]
    emulated = torch.cuda.get_device_capability() < (8, 9)
    assert ("emulated" in result.stdout + result.stderr) == emulated
    assert "16 linear layer(s)" in result.stdout + result.stderr


@pytest.mark.requires_cuda
@pytest.mark.parametrize("overlay", ["tp", "tp_sp", "fsdp_tp"])
def test_tensor_parallel_trains_on_gpus_in_bf16(tmp_path, overlay):
    # TP at the world size there is (1 on a one-GPU machine: a one-rank mesh; tp_sp adds sequence parallelism and
    # the loss on split logits); fsdp_tp's TP=2 needs 2 GPUs.
    if overlay == "fsdp_tp" and torch.cuda.device_count() < 2:
        pytest.skip("fsdp_tp splits 2 ways: 2 GPUs")
    extra = ["--trainer.strategy.init_args.param_dtype=bfloat16"] if overlay == "fsdp_tp" else []
    result = _fit_on_gpus(tmp_path, overlay, "--trainer.precision=bf16-mixed", *extra, *SMOKE)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.requires_cuda
def test_grad_norm_monitor_under_deepspeed_fp16_on_gpus_reads_the_engines_scale(tmp_path):
    # The CPU test's claim (tests/callbacks/test_grad_norm_monitor.py) where DeepSpeed runs fp16 for real: the
    # first steps overflow at 2^20 and are the engine's to skip, and the norms equal its own unscaled norm.
    import json

    from tests.callbacks.test_grad_norm_monitor import DEEPSPEED_FP16_FROM_2_20 as fp16
    from tests.callbacks.test_grad_norm_monitor import monitor_matches_engine
    from tests.support.grad_norms import MONITOR as monitor

    out = tmp_path / "deepspeed"
    record = ["--trainer.callbacks+=tests.support.recorders.RecordDeepSpeedNorms", f"--trainer.callbacks.out_dir={out}"]
    fit = ["--trainer.precision=16-mixed", f"--trainer.strategy.init_args.config={fp16}", "--trainer.max_steps=8"]
    result = _fit_on_gpus(tmp_path, "zero2", *fit, "--trainer.limit_val_batches=0", *monitor, *record)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "deepspeed-rank0.json").read_text())
    assert not all(monitor_matches_engine(rows, rel=1e-2)), rows


def _gpt_trainer(tmp_path, callbacks, steps=12):  # type: ignore[no-untyped-def]
    import lightning.pytorch as pl

    from lightning_mlopt.demos import GPTLanguageModel, TokenDataModule

    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        log_every_n_steps=5,
        callbacks=callbacks,
    )
    return trainer, GPTLanguageModel(), TokenDataModule(num_sequences=512, batch_size=16)


@pytest.mark.requires_cuda
def test_performance_monitor_waits_for_the_gpu_only_on_logging_steps(tmp_path):
    """Under torch.cuda.set_sync_debug_mode("error"), any host sync in the monitor's hooks off logging steps raises."""
    from lightning_mlopt.callbacks import PerformanceMonitor

    class Strict(PerformanceMonitor):
        def _strict(self, trainer, hook, *args):  # type: ignore[no-untyped-def]
            logging_step = self._batches >= 1 and self._batches % 5 == 0  # the batch that ends a window
            torch.cuda.set_sync_debug_mode("default" if logging_step else "error")
            try:
                return hook(trainer, *args)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        def on_train_batch_start(self, trainer, *args):  # type: ignore[no-untyped-def, override]
            return self._strict(trainer, super().on_train_batch_start, *args)

        def on_before_backward(self, trainer, *args):  # type: ignore[no-untyped-def, override]
            return self._strict(trainer, super().on_before_backward, *args)

        def on_before_optimizer_step(self, trainer, *args):  # type: ignore[no-untyped-def, override]
            return self._strict(trainer, super().on_before_optimizer_step, *args)

        def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def, override]
            return self._strict(trainer, super().on_train_batch_end, *args)

    monitor = Strict()
    trainer, model, data = _gpt_trainer(tmp_path, [monitor])
    trainer.fit(model, data)
    metrics = monitor.last_metrics
    assert metrics["perf/samples_per_sec"] > 0
    assert 0.0 < metrics["perf/mfu_measured"] <= 1.0
    name = torch.cuda.get_device_name()
    if any(board in name for board in ("H100", "H200", "A100", "B200")):
        assert 0.0 < metrics["perf/mfu"] <= 1.0


@pytest.mark.requires_cuda
def test_out_of_memory_writes_a_snapshot_named_in_the_error(tmp_path):
    import lightning.pytorch as pl

    from lightning_mlopt.callbacks import PerformanceMonitor

    class Hog(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            if batch_idx == 3:
                torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # a petabyte

    trainer, model, data = _gpt_trainer(tmp_path, [PerformanceMonitor(oom_snapshot_entries=10_000), Hog()])
    with pytest.raises(torch.cuda.OutOfMemoryError) as error:
        trainer.fit(model, data)
    snapshot = tmp_path / "perf" / "oom-rank0.pickle"
    assert snapshot.is_file() and snapshot.stat().st_size > 0
    assert str(snapshot) in "\n".join(getattr(error.value, "__notes__", []))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("overlay", ["ddp", "fsdp"])
def test_no_host_sync_off_logging_steps_with_the_default_callbacks(tmp_path, overlay):
    # Steps 3-7 of a log_every_n_steps=10 run: no logging step among them. The per-step exchange
    # (FaultTolerantCheckpoint's vote) sums host values over gloo; PerformanceMonitor reads its CUDA events on
    # logging steps only. The bar is drawn, as in a terminal, by the clock (it draws the first batch, then not
    # for an hour), and the DDP run's model puts a metric of its own on it. ZeRO is left out: DeepSpeed's own
    # step reads its global norm's validity on the host (tests/perf/test_host_reads.py pins those reads).
    model = ["--model=tests.support.host_reads.GPTWithBarMetrics"] if overlay == "ddp" else []
    result = _fit_on_gpus(
        tmp_path,
        overlay,
        *model,
        "--trainer.max_steps=10",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.callbacks+=lightning_mlopt.callbacks.ThroughputProgressBar",
        "--trainer.callbacks.log_every_n_steps=0",
        "--trainer.callbacks.min_interval_s=3600",
        "--trainer.callbacks+=tests.support.recorders.NoHostSyncBetween",
        "--trainer.callbacks.first_step=3",
        "--trainer.callbacks.last_step=8",
        f"--run_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-4000:]
