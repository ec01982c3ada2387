"""The GPU checklist (../shared/GPU_CHECKLIST.md, items 2, 3, 4 and 6) as one script for a lent GPU machine.

    python benchmarks/gpu/checklist.py                           # CUDA: every section, one GPU
    python benchmarks/gpu/checklist.py --sections step_time,mfu  # some of them
    python benchmarks/gpu/checklist.py --smoke --results /tmp/r  # CPU, a tiny GPT: the plumbing only

Items 1 (the CUDA test tier) and 5 (no host sync off logging steps) are ``pytest -m requires_cuda``
(tests/test_gpu.py). Every job here is a fresh process (its own process group), one device, the GPT demo at
``--size`` (default ``gpu``: 12 layers, d_model 1024, block 1024, vocab 32768, batch 16, bf16-mixed: 219M
parameters; 2.6 GB of fp32 parameters and Adam state, the checkpointed state):

- ``step_time``: our DDP, FSDP and ZeRO-2 against Lightning's ``ddp``, ``ModelParallelStrategy`` (FSDP2,
  ``fully_shard`` in ``configure_model``, the same mixed-precision policy) and ``DeepSpeedStrategy(stage=2)``;
  same job, repeats interleaved, mean step time after warm-up between two device synchronizations.
  Goal: ratio <= 1.00.
- ``mfu``: PerformanceMonitor's ``perf/mfu`` (published peak) and ``perf/mfu_measured`` (matmul probe) against
  Lightning's ThroughputMonitor (``device/mfu``, fed Lightning's own ``measure_flops`` count) on the same run.
- ``checkpoint``: FaultTolerantCheckpoint's time blocking training per save, async against sync, one file
  (DDP) and sharded (FSDP), against the device-to-pinned-host copy of the same state (the floor).
  Goal: async blocking, less any wait for the previous write, <= 1.2 x the copy.
- ``memory``: the memory planner's bytes per rank against ``torch.cuda.max_memory_allocated`` after the first
  optimizer step, per strategy (on CPU: against the state bytes the rank holds).

Results: ``results/gpu_<section>_<device>_<yyyymm>.md`` (``--results`` elsewhere). On a lent machine (10
minutes a call, 30 a session): ``bash benchmarks/gpu/wheels.sh`` here first (the packages its image lacks),
then one device run each, carrying ``.whl``: ``bash benchmarks/gpu/on_device.sh tier``, ``... memory``,
``... step_time,mfu``, ``... checkpoint``; copy what comes back into ``benchmarks/results/``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, median, publish, run_worker, worker_parser, write_result

REPO = Path(__file__).resolve().parents[2]

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {
        "model": {"vocab_size": 32768, "block_size": 1024, "n_layer": 12, "n_head": 16, "d_model": 1024},
        "batch_size": 16,
        "precision": "bf16-mixed",
        "accelerator": "gpu",
    },
    "gpu_half": {
        "model": {"vocab_size": 32768, "block_size": 1024, "n_layer": 6, "n_head": 16, "d_model": 1024},
        "batch_size": 16,
        "precision": "bf16-mixed",
        "accelerator": "gpu",
    },
    "smoke": {
        "model": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "d_model": 64},
        "batch_size": 4,
        "precision": "32-true",
        "accelerator": "cpu",
    },
}
# The step-time table, one row per comparison (``--strategies`` picks rows): the arm, its baseline and the goal
# on their ratio. In this order the rows' arms run, so that the comparisons a user cares about come first:
# what they run (the CLI with its defaults) against a plain loop, then ours against Lightning's own.
STEP_TIME_ROWS: dict[str, tuple[str, str, float | None]] = {
    "cli_ddp": ("cli_ddp", "plain", 1.02),
    "cli_fsdp": ("cli_fsdp", "lightning_fsdp2", 1.00),
    "zero2": ("ours_zero2", "lightning_zero2", 1.00),
    # Our ZeRO-2 preset leaves DeepSpeed's 5e8-element buckets; Lightning's sets 2e8: the first suspect of the
    # 1.12 measured in 2026-11 (one bucket for the 219M model: no reduction overlaps the backward).
    "zero2_buckets": ("ours_zero2_buckets", "lightning_zero2", 1.00),
    "cli_fsdp_hand": ("cli_fsdp", "plain_fsdp2", None),
    "ddp": ("ours_ddp", "lightning_ddp", 1.00),
    "fsdp": ("ours_fsdp", "lightning_fsdp2", 1.00),
    # torch.compile's regional compilation (configs/features/compile.yaml) against the same CLI run eager; the
    # compile itself is in the warm-up steps. torchtitan measured +16% (8B, 8 H100s); no goal until measured here.
    "compile": ("cli_fsdp_compile", "cli_fsdp", None),
    # float8 linears (configs/features/float8.yaml, torchao) on top of compile, as torchtitan measured it (+28%).
    "float8": ("cli_fsdp_compile_float8", "cli_fsdp_compile", None),
}
# Sharded first: it never ran on a GPU yet. The async arms (the goal) before the sync ones (context).
CHECKPOINT_LAYOUTS = {"fsdp": "sharded (FSDP)", "ddp": "one file (DDP)"}
# The checkpoint stall is a ratio to the copy of the same state: half the layers (1.7 GB of state, not 2.6)
# give the same ratio in less device time.
CHECKPOINT_SIZE = {"gpu": "gpu_half"}
MEMORY_ROWS = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "fsdp": "zero3/fsdp", "zero3": "zero3/fsdp"}
NOT_ON_CPU = {
    "lightning_zero2": "Lightning's DeepSpeedStrategy refuses the CPU",
    "plain_fsdp2": "the smoke run has no second process group to spare",
}
SECTIONS = ("step_time", "mfu", "checkpoint", "memory")
COPY_FLOOR_GOAL = 1.2


# ---------------------------------------------------------------------------------------------- one job


def _strategy(name: str, size: dict[str, Any]) -> Any:
    """Our strategy ``name`` (``ddp``, ``fsdp``, ``zero1``...), or Lightning's (``lightning_*``)."""
    import lightning.pytorch as pl

    from lightning_mlopt.strategies import STRATEGIES, DDPStrategy, FSDPStrategy

    bf16 = size["precision"].startswith("bf16")
    if name == "fsdp":
        return FSDPStrategy(
            wrap_classes=["lightning_mlopt.demos.gpt.TransformerBlock"],
            param_dtype="bfloat16" if bf16 else None,
            reduce_dtype="float32" if bf16 else None,
        )
    if name == "ddp":
        return DDPStrategy()
    if name == "zero2_buckets":
        from lightning_mlopt.strategies import DeepSpeedStrategy

        buckets = {"reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000}
        return DeepSpeedStrategy(preset="zero2", config={"zero_optimization": buckets})
    if name in STRATEGIES:
        cls, init_args, _ = STRATEGIES[name]
        return cls(**init_args)
    if name == "lightning_ddp":
        return "ddp"
    if name == "lightning_fsdp2":
        return pl.strategies.ModelParallelStrategy()
    if name == "lightning_zero2":
        return pl.strategies.DeepSpeedStrategy(stage=2)
    raise ValueError(f"unknown strategy {name!r}")


def _model(name: str, size: dict[str, Any]) -> Any:
    """The GPT demo; for Lightning's ModelParallelStrategy, sharded in ``configure_model`` as its docs show."""
    import torch

    from lightning_mlopt.demos import GPTLanguageModel

    if name != "lightning_fsdp2":
        return GPTLanguageModel(**size["model"])
    bf16 = size["precision"].startswith("bf16")

    class FullyShardedGPT(GPTLanguageModel):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = self.device_mesh["data_parallel"]
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
            kwargs: dict[str, Any] = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
            for block in self.model.layers:  # the same units as our overlay's wrap_classes
                fully_shard(block, **kwargs)
            fully_shard(self.model, **kwargs)

    return FullyShardedGPT(**size["model"])


def _fit(
    strategy_name: str,
    size: dict[str, Any],
    steps: int,
    callbacks: list[Any],
    root: str,
    log_every_n_steps: int = 50,
    logger: Any = False,
) -> Any:
    """Train ``steps`` optimizer steps on one device; returns the Trainer."""
    import lightning.pytorch as pl

    from lightning_mlopt.demos import TokenDataModule

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator=size["accelerator"],
        devices=1,
        strategy=_strategy(strategy_name.removeprefix("ours_"), size),
        precision=size["precision"],
        max_steps=steps,
        default_root_dir=root,
        logger=logger,
        log_every_n_steps=log_every_n_steps,
        enable_checkpointing=any(isinstance(callback, pl.callbacks.Checkpoint) for callback in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        callbacks=callbacks,
    )
    data = TokenDataModule(
        vocab_size=size["model"]["vocab_size"],
        block_size=size["model"]["block_size"],
        num_sequences=(steps + 1) * size["batch_size"],
        batch_size=size["batch_size"],
    )
    trainer.fit(_model(strategy_name, size), data)
    return trainer


def _step_time_job(arm: str, size: dict[str, Any], steps: int, warmup: int, root: str) -> dict[str, Any]:
    """Mean seconds per step after ``warmup``, between two device synchronizations (none in between)."""
    if arm.startswith("plain"):
        return _plain_loop_job(arm, size, steps, warmup)
    if arm.startswith("cli_"):
        return _cli_job(arm.removeprefix("cli_"), size, steps, warmup, root)
    from span import SyncedSpan

    span = SyncedSpan(warmup)
    _fit(arm, size, steps, [span], root)
    return {"step_s": span.step_s}


def _plain_loop_job(arm: str, size: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """A plain PyTorch loop of the demo on one device: no Lightning, what a careful user writes by hand.

    The same seed, model, data (the demo's DataModule, its loader), AdamW groups and warm-up (the demo's own
    ``configure_optimizers``), bf16 autocast as ``bf16-mixed`` does, and clipping at 1.0. ``plain_fsdp2``:
    ``fully_shard`` per block and on the model (world size 1) with the overlay's policy, bf16 parameters and
    fp32 reduction, as our FSDP arm and Lightning's ``ModelParallelStrategy`` arm get.
    """
    import torch
    import torch.distributed as dist
    from span import synchronize

    from lightning_mlopt.demos import GPTLanguageModel, TokenDataModule

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
    from hand_loop import _loss, _optimizer

    device = torch.device("cuda" if size["accelerator"] == "gpu" else "cpu")
    bf16 = size["precision"].startswith("bf16")
    torch.manual_seed(0)
    module = GPTLanguageModel(**size["model"]).to(device)
    if arm == "plain_fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from lightning_mlopt.demos.gpt import TransformerBlock

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kwargs: dict[str, Any] = {} if policy is None else {"mp_policy": policy}
        for block in [m for m in module.modules() if isinstance(m, TransformerBlock)]:
            fully_shard(block, **kwargs)
        fully_shard(module.model, **kwargs)
    optimizer, scheduler = _optimizer(module)
    data = TokenDataModule(
        vocab_size=size["model"]["vocab_size"],
        block_size=size["model"]["block_size"],
        num_sequences=(steps + 1) * size["batch_size"],
        batch_size=size["batch_size"],
    )
    data.setup("fit")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    started = 0.0
    for step, (inputs, targets) in enumerate(data.train_dataloader()):
        if step == steps:
            break
        if step == warmup:
            synchronize()
            started = time.perf_counter()
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = _loss(module(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    synchronize()
    elapsed = time.perf_counter() - started
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"step_s": elapsed / (steps - warmup)}


# What a user runs: the README's command with the bundled config and an overlay; the model at --size.
CLI_OVERLAYS = {
    "ddp": ("configs/strategies/ddp.yaml",),
    "fsdp": ("configs/strategies/fsdp.yaml",),
    "fsdp_compile": ("configs/strategies/fsdp.yaml", "configs/features/compile.yaml"),
    "fsdp_compile_float8": (
        "configs/strategies/fsdp.yaml",
        "configs/features/compile.yaml",
        "configs/features/float8.yaml",
    ),
}


def _cli_command(overlay: str, size: dict[str, Any], steps: int, warmup: int, root: str) -> list[str]:
    """``python -m lightning_mlopt fit`` with the GPT config, an overlay and its defaults; the clock added."""
    model, data = size["model"], ("vocab_size", "block_size")
    bf16 = size["precision"].startswith("bf16")
    return [
        sys.executable, "-m", "lightning_mlopt", "fit",
        "--config", str(REPO / "configs" / "gpt.yaml"),
        *[argument for path in CLI_OVERLAYS[overlay] for argument in ("--config", str(REPO / path))],
        f"--trainer.accelerator={size['accelerator']}", "--trainer.devices=1",
        f"--trainer.precision={size['precision']}", f"--trainer.max_steps={steps}",
        *[f"--model.init_args.{key}={value}" for key, value in model.items()],
        *[f"--data.init_args.{key}={model[key]}" for key in data],
        f"--data.init_args.batch_size={size['batch_size']}",
        # As the FSDP arms above: bf16 parameters, fp32 reduction (the overlay's keys).
        *(["--trainer.strategy.init_args.param_dtype=bfloat16", "--trainer.strategy.init_args.reduce_dtype=float32"]
          if overlay.startswith("fsdp") and bf16 else []),
        # The save at the end of training comes after the clock stops: off, to spare device time.
        "--checkpoint.save_on.train_end=false",
        "--trainer.callbacks+=span.SyncedSpan", f"--trainer.callbacks.warmup={warmup}",
        f"--trainer.callbacks.out={root}/span.json", f"--run_dir={root}/run",
    ]  # fmt: skip


def _cli_job(overlay: str, size: dict[str, Any], steps: int, warmup: int, root: str) -> dict[str, Any]:
    """Our CLI as a user runs it, in a pseudo-terminal: the progress bar is drawn as on their screen."""
    import pty
    import subprocess
    import threading

    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    job = subprocess.Popen(
        _cli_command(overlay, size, steps, warmup, root), stdin=subprocess.DEVNULL, stdout=follower,
        stderr=follower, env=env, cwd=root,
    )  # fmt: skip
    os.close(follower)
    screen: list[bytes] = []

    def drain() -> None:  # what the terminal shows; kept for the error message
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                return
            if not chunk:
                return
            screen.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    code = job.wait()
    reader.join(timeout=5)
    os.close(leader)
    if code != 0:
        raise RuntimeError(f"the CLI exited {code}: {b''.join(screen)[-3000:].decode(errors='replace')}")
    return json.loads((Path(root) / "span.json").read_text())


def _recording_logger() -> Any:
    """A Lightning logger that keeps every logged row in memory (``.rows``) and writes nothing."""
    from lightning.pytorch.loggers import Logger

    class Recording(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict[str, float]] = []

        @property
        def name(self) -> str:
            return "recording"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append({key: float(value) for key, value in metrics.items()})

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    return Recording()


def _lightning_flops_per_batch(size: dict[str, Any]) -> int:
    """FLOPs of one batch's forward and backward as Lightning's docs count them (``measure_flops``, meta device)."""
    import torch
    from lightning.fabric.utilities.throughput import measure_flops

    from lightning_mlopt.demos import GPTLanguageModel

    model_size = size["model"]
    with torch.device("meta"):
        model = GPTLanguageModel(**model_size)
        tokens = torch.randint(0, model_size["vocab_size"], (size["batch_size"], model_size["block_size"]))
    return measure_flops(model, lambda: model(tokens), lambda logits: logits.sum())


def _mfu_job(size: dict[str, Any], steps: int, warmup: int, root: str) -> dict[str, Any]:
    """PerformanceMonitor and Lightning's ThroughputMonitor (FLOPs counted Lightning's way) on one run, our DDP."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ThroughputMonitor

    from lightning_mlopt.callbacks import PerformanceMonitor
    from lightning_mlopt.run_dir import PERF_DIR, PERF_SUMMARY_NAME

    flops_per_batch = _lightning_flops_per_batch(size)

    class FlopsPerBatch(pl.Callback):
        """ThroughputMonitor reads ``flops_per_batch`` off the module (its documented contract)."""

        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            pl_module.flops_per_batch = flops_per_batch  # type: ignore[attr-defined]

    throughput = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0], window_size=warmup)
    recording = _recording_logger()
    callbacks = [PerformanceMonitor(log_every_n_steps=warmup), FlopsPerBatch(), throughput]
    _fit("ours_ddp", size, steps, callbacks, root, warmup, recording)
    last: dict[str, float] = {}
    for row in recording.rows:
        last.update(row)
    summary = json.loads((Path(root) / PERF_DIR / PERF_SUMMARY_NAME).read_text())
    return {
        "ours": {
            key: summary["metrics"][key]
            for key in ("perf/mfu", "perf/mfu_measured", "perf/samples_per_sec")
            if key in summary["metrics"]
        },
        # ThroughputMonitor's keys carry the stage: train/device/mfu, train/device/samples_per_sec.
        "lightning": {key.removeprefix("train/"): last[key] for key in last if key.startswith("train/device/")},
        "ours_flops_per_sample": summary["flops_per_sample"],
        "lightning_flops_per_sample": flops_per_batch / size["batch_size"],
        "published_peak": summary["published_peak_flops"],
    }


def _state_tensors(trainer: Any) -> list[Any]:
    """The rank-local tensors a checkpoint of this trainer holds: parameters and optimizer state."""
    import torch

    from lightning_mlopt.distributed.state import _local

    tensors = [_local(p) for p in trainer.lightning_module.parameters()]
    for state in trainer.optimizers[0].state.values():
        tensors += [_local(value) for value in state.values() if isinstance(value, torch.Tensor)]
    return [t for t in tensors if t.numel()]


def _copy_floor_s(tensors: list[Any]) -> float:
    """Seconds to copy ``tensors`` into preallocated pinned host memory (second of two rounds)."""
    import torch
    from span import synchronize as _synchronize

    pinned = torch.cuda.is_available()
    buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned) for t in tensors]
    seconds = 0.0
    for _ in range(2):
        _synchronize()
        started = time.perf_counter()
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor, non_blocking=pinned)
        _synchronize()
        seconds = time.perf_counter() - started
    return seconds


def _checkpoint_job(arm: str, size: dict[str, Any], steps: int, root: str) -> dict[str, Any]:
    """Save every ``steps // 3`` steps; the blocking time of each save but the first (it allocates staging).

    A save first waits for the previous background write (``checkpoint/wait_s``, logged by the saver): the
    staging cost the goal is about is the blocking time less that wait. On a GPU a save also waits for the
    step's queued kernels before its copies can run (the host is ahead of the device): the GPU is busy
    meanwhile, so that wait is no staging cost. It is taken before each save here (``drain_s``, reported
    apart), so ``blocking_s`` is the staging alone, comparable with the copy floor.
    """
    import lightning.pytorch as pl
    from span import synchronize

    from lightning_mlopt.callbacks import FaultTolerantCheckpoint, Keep, SaveOn

    strategy, mode = arm.split("_")
    every = max(1, steps // 3)
    checkpoint = FaultTolerantCheckpoint(
        dirpath=str(Path(root) / "checkpoints"),
        every_n_steps=every,
        async_save=mode == "async",
        save_on=SaveOn(epoch_end=False, train_end=False),
        keep=Keep(last=2),
    )
    floor: dict[str, float] = {}

    class CopyFloor(pl.Callback):
        """The floor, measured at the end of training (at teardown Lightning moves the module to the CPU)."""

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            tensors = _state_tensors(trainer)
            floor["copy_s"] = _copy_floor_s(tensors)
            floor["state_bytes"] = sum(t.numel() * t.element_size() for t in tensors)

    drains: list[float] = []

    class DrainBeforeSave(pl.Callback):
        """Waits for the device right before each save (Lightning runs checkpoint callbacks last)."""

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step % every == 0:
                started = time.perf_counter()
                synchronize()
                drains.append(time.perf_counter() - started)

    _fit(f"ours_{strategy}", size, steps, [checkpoint, DrainBeforeSave(), CopyFloor()], root)
    assert checkpoint.saver is not None
    timings = checkpoint.saver.save_timings
    blocking = [timing["checkpoint/blocking_s"] for timing in timings]
    waits = [timing["checkpoint/wait_s"] for timing in timings]
    writes = [timing["checkpoint/background_s"] for timing in timings if "checkpoint/background_s" in timing]
    return {
        "blocking_s": blocking[1:] or blocking,
        "wait_s": waits[1:] or waits,
        "background_s": writes,
        "drain_s": drains[1:] or drains,
        **floor,
    }


def _memory_job(arm: str, size: dict[str, Any], root: str) -> dict[str, Any]:
    """Measured bytes after the first optimizer step, and the planner's row for the strategy."""
    import lightning.pytorch as pl
    import torch

    from lightning_mlopt.demos import GPTLanguageModel, TokenDataModule
    from lightning_mlopt.distributed.state import local_state_bytes
    from lightning_mlopt.planning.memory import plan_memory
    from lightning_mlopt.planning.probe import measure_activations

    class AfterFirstStep(pl.Callback):
        measured: dict[str, int] = {}

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            if not self.measured:
                state = local_state_bytes(pl_module, trainer.optimizers[0])
                self.measured = {"state": state.total}
                if torch.cuda.is_available():
                    self.measured["max_allocated"] = torch.cuda.max_memory_allocated()

    probe = AfterFirstStep()
    trainer = _fit(f"ours_{arm}", size, 2, [probe], root)
    with torch.device("meta"):
        meta = GPTLanguageModel(**size["model"])
    data = TokenDataModule(
        vocab_size=size["model"]["vocab_size"],
        block_size=size["model"]["block_size"],
        num_sequences=4 * size["batch_size"],
        batch_size=size["batch_size"],
    )
    params = sum(p.numel() for p in meta.parameters())
    device_memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 2**40
    precision = "mixed" if size["precision"].startswith(("bf16", "16")) else "fp32"
    plan = plan_memory(params, trainer.world_size, device_memory, precision, "adam", measure_activations(meta, data))
    row = next(row for row in plan.rows if row.strategy == MEMORY_ROWS[arm])
    return {
        **probe.measured,
        "planned_total": row.total,
        "planned_state": row.parameters + row.gradients + row.optimizer_state,
        "planned_activations": row.activations,
    }


def _worker(mode: str, args: Any) -> None:
    section, arm = mode.split(":")
    size = SIZES[CHECKPOINT_SIZE.get(args.size, args.size) if section == "checkpoint" else args.size]
    # Removed at the end of the job: the checkpoint jobs keep 2 saves of 2.6 GB each, and the lent
    # machine's disk holds 64 GiB.
    with tempfile.TemporaryDirectory(prefix="gpu_checklist_") as root:
        if section == "step_time":
            result = _step_time_job(arm, size, args.steps, args.warmup, root)
        elif section == "mfu":
            result = _mfu_job(size, args.steps, args.warmup, root)
        elif section == "checkpoint":
            result = _checkpoint_job(arm, size, args.steps, root)
        else:
            result = _memory_job(arm, size, root)
    args.out.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- the sections


def _job(mode: str, args: Any) -> dict[str, Any]:
    if args.smoke:
        result = _forked_job(mode, args)
    else:
        result = run_worker(__file__, mode, args.steps, args.warmup, ["--size", args.size])
    print(f"{mode}: {json.dumps(result)[:200]}", flush=True)
    return result


def _preload() -> None:
    """Import what every job imports, once, so that ``--smoke``'s forked jobs start without paying for it."""
    import lightning.pytorch  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import lightning_mlopt.callbacks
    import lightning_mlopt.demos
    import lightning_mlopt.strategies  # noqa: F401


def _forked_job(mode: str, args: Any) -> dict[str, Any]:
    """``--smoke``'s job: a fork of this process, whose imports are done (`_preload`).

    A fresh interpreter per job spends about 5 s of a CPU's time importing torch and Lightning, most of the smoke
    run; on a GPU each job stays a fresh process (CUDA does not survive a fork, and the timings want a clean one).
    The ``cli_*`` arms still launch ``python -m lightning_mlopt`` themselves: that launch is what they measure.
    """
    import traceback
    import warnings

    handle, name = tempfile.mkstemp(prefix="gpu_checklist_job_", suffix=".json")
    os.close(handle)
    out, log = Path(name), Path(name).with_suffix(".log")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the job: its output kept apart, as run_worker keeps a fresh job's
        status = 1
        try:
            descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(descriptor, 1)
            os.dup2(descriptor, 2)
            warnings.simplefilter("ignore")  # what run_worker's PYTHONWARNINGS=ignore does for a fresh job
            args.out = out
            _worker(mode, args)
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    try:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 0:  # say why, as run_worker does
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            raise RuntimeError(f"worker {mode!r} exited {code}; its output ends:\n{tail}")
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
        log.unlink(missing_ok=True)


def _setup_line(args: Any) -> str:
    size = SIZES[args.size]
    m = size["model"]
    return (
        f"GPT demo ({m['n_layer']} layers, d_model {m['d_model']}, block {m['block_size']}, vocab {m['vocab_size']}"
        f"), batch {size['batch_size']}, {size['precision']}, AdamW, clip 1.0, one {size['accelerator'].upper()} "
        f"device, {args.steps} steps per job, first {args.warmup} excluded, {args.repeats} interleaved repeats."
    )


def _chosen(table: dict[str, Any], args: Any) -> list[str]:
    """The keys of ``table`` that ``--strategies`` names (all of them by default)."""
    return [key for key in table if args.strategies is None or key in args.strategies]


def step_time(args: Any) -> str:
    rows = {key: STEP_TIME_ROWS[key] for key in _chosen(STEP_TIME_ROWS, args)}
    arms = list(dict.fromkeys(arm for arm, baseline, _ in rows.values() for arm in (arm, baseline)))
    refused = {arm: NOT_ON_CPU[arm] for arm in arms if args.smoke and arm in NOT_ON_CPU}
    arms = [arm for arm in arms if arm not in refused]
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    body = ""
    for repeat in range(args.repeats):
        for arm in arms if repeat % 2 == 0 else arms[::-1]:
            times[arm].append(_job(f"step_time:{arm}", args)["step_s"])
            body = _step_time_table(args, rows, times, refused)
            write_result("gpu_step_time", _device_tag(args.smoke), body, args.results)  # kept if the call ends
    return body


def _step_time_table(
    args: Any, rows: dict[str, tuple[str, str, float | None]], times: dict[str, list[float]], refused: dict[str, str]
) -> str:
    """The table so far: every row whose two arms have at least one repeat."""
    lines = [
        "| comparison | arm | baseline | arm (ms/step) | baseline (ms/step) | ratio | goal |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, (arm, baseline, goal) in rows.items():
        if arm in refused or baseline in refused:
            lines.append(f"| {key} | {arm} | {baseline} | | | | {refused.get(arm) or refused[baseline]} |")
            continue
        if not times.get(arm) or not times.get(baseline):
            lines.append(f"| {key} | {arm} | {baseline} | | | | not run (the call ended first) |")
            continue
        mine, base = median(times[arm]), median(times[baseline])
        verdict = "-" if goal is None else f"<= {goal:.2f}: {'met' if mine / base <= goal else 'NOT met'}"
        lines.append(
            f"| {key} | {arm} | {baseline} | {mine * 1e3:.1f} | {base * 1e3:.1f} | {mine / base:.3f} | {verdict} |"
        )
    counts = ", ".join(f"{arm} {len(seconds)}" for arm, seconds in times.items())
    arms_note = (
        " Arms: `plain`, a PyTorch loop with no Lightning (bf16 autocast); `plain_fsdp2`, the same with"
        " `fully_shard` (bf16 parameters, fp32 reduction); `cli_*`, `python -m lightning_mlopt fit --config"
        " configs/gpt.yaml --config configs/strategies/<overlay>.yaml` with its defaults, in a pseudo-terminal"
        " (the bar drawn); `ours_*`/`lightning_*`, a bare Trainer (no logger, no bar). Repeats per arm: "
    )
    return _setup_line(args) + arms_note + counts + ".\n\n" + "\n".join(lines) + "\n"


def mfu(args: Any) -> str:
    result = _job("mfu:ours_ddp", args)
    peak = result["published_peak"]
    rows = [
        "| | FLOPs per sample | MFU (published peak) | MFU (measured matmul peak) | samples/s |",
        "|---|---|---|---|---|",
        _mfu_row("PerformanceMonitor (whole run)", result["ours_flops_per_sample"], result["ours"], "perf"),
        _mfu_row(
            "ThroughputMonitor (last window)", result["lightning_flops_per_sample"], result["lightning"], "device"
        ),
    ]
    return (
        _setup_line(args)
        + " Both callbacks on the same run (our DDP). Published dense peak: "
        + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "none for this device")
        + "; ThroughputMonitor is fed Lightning's own count (`measure_flops` on the meta device, forward and "
        "backward), PerformanceMonitor counts its own on the first batch.\n\n" + "\n".join(rows) + "\n"
    )


def _mfu_row(label: str, flops_per_sample: float | None, metrics: dict[str, float], prefix: str) -> str:
    def shown(key: str) -> str:
        value = metrics.get(key)
        return "-" if value is None else f"{value:.4g}"

    flops = "-" if flops_per_sample is None else f"{flops_per_sample:.4g}"
    measured = shown("perf/mfu_measured") if prefix == "perf" else "-"
    return f"| {label} | {flops} | {shown(f'{prefix}/mfu')} | {measured} | {shown(f'{prefix}/samples_per_sec')} |"


def checkpoint(args: Any) -> str:
    layouts = _chosen(CHECKPOINT_LAYOUTS, args)
    arms = [f"{layout}_{mode}" for mode in ("async", "sync") for layout in layouts]
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    body = ""
    for repeat in range(args.repeats):
        for arm in arms if repeat % 2 == 0 else arms[::-1]:
            runs[arm].append(_job(f"checkpoint:{arm}", args))
            body = _checkpoint_table(args, layouts, runs)
            write_result("gpu_checkpoint", _device_tag(args.smoke), body, args.results)  # kept if the call ends
    return body


def _checkpoint_table(args: Any, layouts: list[str], runs: dict[str, list[dict[str, Any]]]) -> str:
    rows = [
        "| layout | state (GB) | copy to host (s) | GPU drain before a save (s) | sync save blocks (s) | async blocks "
        "(s) | of which waiting for the previous write (s) | async write (s) | (async blocks - wait) / copy | goal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout in layouts:
        async_runs, sync_runs = runs[f"{layout}_async"], runs[f"{layout}_sync"]
        if not async_runs:
            rows.append(f"| {CHECKPOINT_LAYOUTS[layout]} | | | | | | | | | not run (the call ended first) |")
            continue
        sync = f"{median([s for run in sync_runs for s in run['blocking_s']]):.3f}" if sync_runs else "-"
        blocking = median([s for run in async_runs for s in run["blocking_s"]])
        waited = median([s for run in async_runs for s in run["wait_s"]])
        staging = median([b - w for run in async_runs for b, w in zip(run["blocking_s"], run["wait_s"], strict=True)])
        copy = median([run["copy_s"] for run in async_runs])
        writes = [s for run in async_runs for s in run["background_s"]]
        write = f"{median(writes):.3f}" if writes else "-"
        ratio = staging / copy if copy else float("inf")
        drain = median([s for run in async_runs for s in run.get("drain_s", [])] or [0.0])
        rows.append(
            f"| {CHECKPOINT_LAYOUTS[layout]} | {async_runs[0]['state_bytes'] / 1e9:.3f} | {copy:.4f} | {drain:.4f} | "
            f"{sync} | "
            f"{blocking:.3f} | {waited:.3f} | {write} | {ratio:.2f} | "
            f"<= {COPY_FLOOR_GOAL}: {'met' if ratio <= COPY_FLOOR_GOAL else 'NOT met'} |"
        )
    model = SIZES[CHECKPOINT_SIZE.get(args.size, args.size)]["model"]
    return (
        _setup_line(args)
        + f" Here the model has {model['n_layer']} layers (the ratio to the copy does not need the whole state)."
        " A save every steps/3 steps; the first save of a job is left out. A save first waits for the previous"
        " background write when saves come faster than writes end: that wait is shown, and taken out of the"
        " figure the goal is about (the staging copy that holds training).\n\n" + "\n".join(rows) + "\n"
    )


def memory(args: Any) -> str:
    measured_key = "max_allocated" if SIZES[args.size]["accelerator"] == "gpu" else "state"
    note = (
        "Measured: torch.cuda.max_memory_allocated after the first optimizer step, against the planner's total."
        if measured_key == "max_allocated"
        else "Measured on CPU: the state bytes the rank holds after the first step, against the planner's state."
    )
    body = ""
    rows = [
        f"| strategy | planner row | planned state (GB) | planned activations (GB) | planned total (GB) | measured "
        f"{measured_key} (GB) | measured / planned |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in _chosen(MEMORY_ROWS, args):
        row = MEMORY_ROWS[arm]
        result = _job(f"memory:{arm}", args)
        planned = result["planned_total"] if measured_key == "max_allocated" else result["planned_state"]
        rows.append(
            f"| {arm} | {row} | {result['planned_state'] / 1e9:.3f} | {result['planned_activations'] / 1e9:.3f} | "
            f"{result['planned_total'] / 1e9:.3f} | {result[measured_key] / 1e9:.3f} | "
            f"{result[measured_key] / planned:.2f} |"
        )
        body = _setup_line(args) + f" {note}\n\n" + "\n".join(rows) + "\n"
        write_result("gpu_memory", _device_tag(args.smoke), body, args.results)  # kept if the call ends
    return body


def _device_tag(smoke: bool) -> str:
    import torch

    if smoke or not torch.cuda.is_available():
        return "cpu-smoke"
    name = torch.cuda.get_device_name().lower()
    return next((tag for tag in ("h200", "h100", "b200", "a100") if tag in name), name.replace(" ", "-"))


def main() -> None:
    # Two repeats of 40 steps: on a lent GPU a job's start-up (imports, NCCL, DeepSpeed) is most of its time,
    # and a device call has 10 minutes.
    parser = worker_parser(__doc__, repeats=2, steps=40, warmup=10, workers=None)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu")
    parser.add_argument(
        "--strategies", type=lambda text: text.split(","), help="comma-separated: only these (ddp, fsdp, zero1...)"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny GPT, 8 steps, one repeat")
    parser.add_argument(
        "--results", type=Path, help="where the result files go (default: results/; a temporary folder with --smoke)"
    )
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args)
        return
    if args.smoke:  # its figures are no results: never into the committed folder unless asked
        args.size, args.steps, args.warmup, args.repeats = "smoke", 8, 4, 1
        args.results = args.results or Path(tempfile.mkdtemp(prefix="gpu_checklist_smoke_"))
        _preload()
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("error: no CUDA device here; --smoke runs the plumbing on CPU")
    if not 0 <= args.warmup < args.steps:
        sys.exit(f"error: --warmup ({args.warmup}) must be below --steps ({args.steps}): nothing would be timed")
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        sys.exit(f"error: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    args.results = args.results or RESULTS
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for name in sections:
        body = globals()[name](args)
        publish(f"gpu_{name}", _device_tag(args.smoke), body, args.results)


if __name__ == "__main__":
    main()
