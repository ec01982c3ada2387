"""ZeRO on CPU starts without compiling DeepSpeed's shared-memory op and without its accelerator guess on each rank.

benchmarks/zero_startup/ measures what this saves (the compile was the first launch on each machine).
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_mlopt.strategies.deepspeed.deepspeed_startup import name_deepspeed_accelerator, uses_shm_op
from tests.conftest import CONFIGS, SMOKE, failure_report, run_cli

BUILT = "built successfully"  # DeepSpeed's print after loading (or compiling) a JIT op, in each rank
GUESSED = "Setting accelerator to CPU"  # DeepSpeed's warning when its probe finds no accelerator


@pytest.mark.skipif(torch.accelerator.is_available(), reason="DeepSpeed detects this machine's accelerator itself")
def test_the_cpu_is_named_for_deepspeed_unless_the_user_named_an_accelerator(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    name_deepspeed_accelerator()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    name_deepspeed_accelerator()
    assert os.environ["DS_ACCELERATOR"] == "xpu", "the user's choice is kept"


def test_only_autotp_reaches_the_shared_memory_op():
    assert not uses_shm_op({"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 1}})
    assert uses_shm_op({"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}})


@pytest.mark.multiprocess
def test_a_zero_launch_compiles_nothing_and_no_process_announces_the_accelerator(tmp_path, monkeypatch):
    # An empty extension folder is the first launch on a machine, when DeepSpeed compiled its shm op (~40 s here),
    # and then loaded it and said "built successfully" in every rank on every launch. DS_ACCELERATOR unset, as a
    # user's shell has it (a test of this process may have set it).
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    extensions = tmp_path / "torch_extensions"
    env = {"TORCH_EXTENSIONS_DIR": str(extensions)}
    fit = [
        "fit",
        "--config",
        str(CONFIGS / "gpt.yaml"),
        "--trainer.strategy=zero2",
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        f"--run_dir={tmp_path / 'run'}",
        *SMOKE,
    ]
    result = run_cli(fit, cwd=tmp_path, env=env)
    assert result.returncode == 0, failure_report(result)
    output = result.stdout + result.stderr
    assert output.count("DeepSpeed settings in force: stage=2") == 1  # ZeRO-2 ran
    assert BUILT not in output
    assert GUESSED not in output, "a rank announced DeepSpeed's accelerator guess"
    assert not extensions.exists() or not any(extensions.iterdir()), f"built: {sorted(extensions.rglob('*'))}"

    # `checkpoint consolidate` unpickles DeepSpeed's files, which imports DeepSpeed in its own process.
    (checkpoint,) = (tmp_path / "run" / "checkpoints").glob("step-*")
    merged = run_cli(["checkpoint", "consolidate", str(checkpoint), str(tmp_path / "one.ckpt")], cwd=tmp_path, env=env)
    assert merged.returncode == 0, failure_report(merged)
    assert GUESSED not in merged.stdout + merged.stderr
    assert (tmp_path / "one.ckpt").is_file()
