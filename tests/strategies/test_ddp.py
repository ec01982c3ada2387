"""DDPStrategy: knob validation (unit) and communication hooks on CPU through the real Trainer (2 processes)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from lightning_mlopt.strategies import DDPStrategy
from lightning_mlopt.strategies.ddp import bf16_compress_hook
from tests.conftest import CONFIGS, SMOKE, run_cli
from tests.support.cli_args import fit_args
from tests.support.recorders import read_records


def test_knobs_reach_distributed_data_parallel():
    strategy = DDPStrategy(bucket_cap_mb=50, gradient_as_bucket_view=True, static_graph=True, timeout_minutes=2)
    assert strategy._ddp_kwargs == {
        "bucket_cap_mb": 50,
        "gradient_as_bucket_view": True,
        "static_graph": True,
        "find_unused_parameters": False,
    }
    assert strategy._timeout.total_seconds() == 120


@pytest.mark.parametrize(
    ("name", "hook"),
    [("none", None), ("fp16", default_hooks.fp16_compress_hook), ("bf16", bf16_compress_hook)],
)
def test_comm_hook_by_name(name, hook):
    assert DDPStrategy(comm_hook=name)._comm_hook_fn is hook


def test_powersgd_defaults_and_knobs():
    strategy = DDPStrategy(comm_hook="powersgd", powersgd_rank=4, powersgd_start_iter=10)
    assert strategy._comm_hook_fn is powerSGD_hook.powerSGD_hook
    assert strategy._comm_state.matrix_approximation_rank == 4
    assert strategy._comm_state.start_powerSGD_iter == 10
    assert DDPStrategy(comm_hook="powersgd")._comm_state.matrix_approximation_rank == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"comm_hook": "fp16", "powersgd_rank": 2}, "only apply with comm_hook: powersgd"),
        ({"comm_hook": "powersgd", "powersgd_rank": 0}, "powersgd_rank must be >= 1"),
        ({"comm_hook": "powersgd", "powersgd_start_iter": 1}, "powersgd_start_iter must be >= 2"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be > 0"),
        ({"timeout_minutes": -1}, "timeout_minutes must be > 0"),
        ({"comm_hook": "int8"}, "comm_hook must be one of"),
    ],
)
def test_wrong_knob_gets_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DDPStrategy(**kwargs)


@pytest.mark.multiprocess
def test_fp16_hook_is_registered_on_cpu_and_ranks_stay_in_sync(tmp_path):
    """Lightning skips comm hooks off CUDA; ours registers them, and replicas stay identical."""
    out = tmp_path / "records"
    result = run_cli(
        fit_args(
            *SMOKE,
            "--trainer.max_steps=3",
            "--trainer.callbacks+=tests.support.recorders.RecordTraining",
            f"--trainer.callbacks.out_dir={out}",
            strategy="ddp_fp16",
            quiet=False,
        ),
        cwd=tmp_path,
        preloaded=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_records(out)
    assert [r["rank"] for r in records] == [0, 1]
    assert {r["strategy"] for r in records} == {"DDPStrategy"}
    assert {r["comm_hook"] for r in records} == {"fp16_compress_hook"}
    assert records[0]["pid"] != records[1]["pid"]
    # DDP's invariant: all replicas hold the same parameters after every step.
    assert records[0]["param_sum"] == records[1]["param_sum"]
    assert len(records[0]["losses"]) == 3


@pytest.mark.requires_cuda
def test_bf16_hook_on_nccl(tmp_path):
    result = run_cli(
        [
            "fit",
            "--config",
            str(CONFIGS / "gpt.yaml"),
            "--trainer.strategy=ddp_bf16",
            "--trainer.accelerator=gpu",
            f"--trainer.devices={min(2, torch.cuda.device_count())}",
            *SMOKE,
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_powersgd_says_when_it_starts_and_warns_when_a_run_ends_before(caplog):
    from types import SimpleNamespace

    strategy = DDPStrategy(comm_hook="powersgd", powersgd_start_iter=1000)
    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(max_steps=50))  # type: ignore[assignment]
    with caplog.at_level("INFO"), pytest.warns(UserWarning, match="PowerSGD never compresses in this run"):
        strategy._say_when_powersgd_starts(strategy._comm_state)
    assert "compresses gradients from iteration 1000" in caplog.text
