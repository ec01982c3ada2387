"""The same strategies on CUDA with NCCL and bf16 mixed precision (skipped where there is no GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CONFIGS, SMOKE, run_cli


@pytest.mark.requires_cuda
@pytest.mark.parametrize("overlay", ["ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload"])
def test_strategy_trains_on_gpus_in_bf16(tmp_path, overlay):
    devices = min(2, torch.cuda.device_count())
    extra = ["--trainer.strategy.init_args.param_dtype=bfloat16"] if overlay == "fsdp" else []
    result = run_cli(
        [
            "fit",
            "--config",
            str(CONFIGS / "gpt.yaml"),
            "--config",
            str(CONFIGS / "strategies" / f"{overlay}.yaml"),
            "--trainer.accelerator=gpu",
            f"--trainer.devices={devices}",
            "--trainer.precision=bf16-mixed",
            *extra,
            *SMOKE,
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
