"""PerformanceMonitor: the numbers it computes, and what it reports on 2 real CPU processes."""

from __future__ import annotations

import gzip
import json
import re
import time

import pytest
import torch

from lightning_mlopt.callbacks import PerformanceMonitor
from lightning_mlopt.demos.gpt import GPT
from lightning_mlopt.perf.breakdown import JobWindow, RankWindow, pack, unpack
from lightning_mlopt.perf.flops import TrainingFlopCounter, transformer_training_flops
from lightning_mlopt.perf.peaks import matmul_precision, measure_peak_flops, published_peak_flops
from lightning_mlopt.perf.phase_clock import PhaseClock
from lightning_mlopt.process.phase import phase, set_phase
from tests.conftest import failure_report, run_cli
from tests.support.cli_args import fit_args


def test_gpt_flop_count_matches_the_transformer_formula_within_2_percent():
    n_layer, d_model, vocab, batch, seq = 4, 128, 256, 16, 64  # configs/gpt.yaml
    model = GPT(vocab, seq, n_layer, n_head=4, d_model=d_model, dropout=0.0)
    tokens = torch.randint(0, vocab, (batch, seq))
    with TrainingFlopCounter() as counter:
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    analytic = transformer_training_flops(n_layer, d_model, vocab, batch, seq)
    assert counter.total == pytest.approx(analytic, rel=0.02)
    assert counter.total > analytic  # attention counted (CPU kernels included), flash's recompute on top


@pytest.mark.solo  # an MFU against the matmul peak measured in the run: another worker beside it skews it
def test_mfu_against_the_measured_peak_is_a_fraction():
    model = GPT(256, 64, 2, n_head=4, d_model=128, dropout=0.0)
    tokens = torch.randint(0, 256, (8, 64))
    with TrainingFlopCounter() as counter:
        model(tokens).sum().backward()
    start = time.perf_counter()
    for _ in range(3):
        model(tokens).sum().backward()
    seconds = (time.perf_counter() - start) / 3
    window = RankWindow(
        seconds=seconds, flops=counter.total, measured_peak_flops=measure_peak_flops(torch.device("cpu"))
    )
    mfu = JobWindow([window]).mfu_measured()
    assert mfu is not None and 0.0 < mfu <= 1.0


def test_published_peaks_match_real_board_names_and_never_guess():
    assert published_peak_flops("NVIDIA H200", "bf16") == pytest.approx(989.4e12)
    assert published_peak_flops("NVIDIA H100 80GB HBM3", "fp8") == pytest.approx(1978.9e12)
    assert published_peak_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756e12)
    assert published_peak_flops("NVIDIA A100-SXM4-40GB", "tf32") == pytest.approx(156e12)
    assert published_peak_flops("AMD Instinct MI300X", "bf16") == pytest.approx(1307.4e12)
    assert published_peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no FP8 on an A100
    assert published_peak_flops("NVIDIA RTX A1000", "bf16") is None  # not an A100
    assert published_peak_flops("Tesla V100-SXM2-16GB", "fp16") is None
    assert matmul_precision("bf16-mixed") == "bf16" and matmul_precision("16-mixed") == "fp16"


def test_window_vector_round_trips_and_names_the_stalled_and_slowest_ranks():
    fast = RankWindow(seconds=1.0, data=0.05, forward=0.3, backward=0.5, optimizer=0.15, batches=10, samples=160)
    stalled = RankWindow(seconds=1.0, data=0.45, forward=0.2, backward=0.25, optimizer=0.1, batches=10, samples=160)
    summed = [a + b for a, b in zip(pack(fast, 0, 2), pack(stalled, 1, 2), strict=True)]
    job = JobWindow(unpack(summed, 2))
    assert job.ranks == [fast, stalled]
    assert job.stalled_ranks(0.1) == [1]
    assert job.slowest_rank() == 0
    metrics = job.metrics()
    assert metrics["perf/samples_per_sec"] == pytest.approx(320.0)
    assert metrics["perf/frac_data_wait_max"] == pytest.approx(0.45)
    assert metrics["perf/data_wait_max_rank"] == 1.0


def test_a_stall_is_said_once_per_set_of_ranks_even_when_it_comes_back(recwarn):
    fast = RankWindow(seconds=1.0, data=0.05, batches=10)
    slow = RankWindow(seconds=1.0, data=0.45, batches=10)
    monitor = PerformanceMonitor()
    # Rank 1 stalls, recovers, stalls again (each epoch's start, say): one finding, one warning.
    for ranks in ([fast, slow], [fast, fast], [fast, slow], [slow, slow], [fast, slow]):
        monitor._check_stalls(JobWindow(ranks))
    said = [str(w.message) for w in recwarn if "input-stalled" in str(w.message)]
    assert len(said) == 2, said
    assert "rank 1 45% of the step" in said[0] and "rank 0 45%, rank 1 45%" in said[1]
    assert monitor.stalled == [1]  # the newest window's verdict


def test_an_mfu_above_one_is_a_counting_error_not_a_metric():
    monitor = PerformanceMonitor(flops_per_sample=1e12)
    monitor._flops_per_sample = 1e12
    window = RankWindow(seconds=1.0, batches=1, samples=16, flops=16e12, measured_peak_flops=1e12)
    with pytest.warns(UserWarning, match="above 1"):
        metrics = monitor.metrics_of(JobWindow([window]))
    assert "perf/mfu_measured" not in metrics


def test_phase_clock_adds_up_time_per_phase_and_leaves_out_other_work():
    clock = PhaseClock(torch.device("cpu")).attach()
    try:
        set_phase("forward")
        time.sleep(0.05)
        set_phase("backward")
        time.sleep(0.02)
        with phase("monitor"):
            time.sleep(0.03)
        set_phase("data")
        seconds = clock.take()
    finally:
        clock.detach()
        set_phase("setup")
    # Each phase took at least its sleep; scheduling on a loaded machine may add to it, never take from it.
    for name, slept in (("forward", 0.05), ("backward", 0.02), ("monitor", 0.03)):
        assert slept <= seconds[name] < slept + 0.04, (name, seconds)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"profile_steps": [8, 4]}, "0 <= start < stop"),
        ({"profile_steps": [0, 50]}, "at most 20"),
        ({"stall_threshold": 1.5}, "stall_threshold"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PerformanceMonitor(**kwargs)


@pytest.mark.multiprocess
@pytest.mark.solo  # its data-wait fraction is measured: another worker beside it skews it
def test_two_ranks_input_stall_slowest_rank_trace_and_summary(tmp_path):
    """Rank 1's collate sleeps 50 ms, rank 0's forward 30 ms: both named; a trace per rank; the job finishes."""
    run_dir = tmp_path / "run"
    result = run_cli(
        fit_args(
            "--data=tests.support.models.SlowCollateTokens",
            "--data.collate_sleep_s=0.05",
            "--data.slow_ranks=[1]",
            "--model.n_layer=1",
            "--model.d_model=64",
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.log_every_n_steps=5",
            "--trainer.callbacks+=tests.support.faults.SlowRank",
            "--trainer.callbacks.rank=0",
            "--trainer.callbacks.seconds=0.03",
            "--performance.profile_steps=[4,6]",
            steps=20,
            run_dir=run_dir,
        ),
        cwd=tmp_path,
        preloaded=True,
    )
    assert result.returncode == 0, failure_report(result)
    stalls = re.findall(r"input-stalled: .*?: ((?:rank \d+ \d+%(?:, )?)+) of the step", result.stderr)
    assert stalls, result.stderr[-3000:]
    named = dict(re.findall(r"rank (\d+) (\d+)%", stalls[0]))
    assert list(named) == ["1"] and int(named["1"]) > 30
    summary = json.loads((run_dir / "perf" / "summary.json").read_text())
    metrics = summary["metrics"]
    assert metrics["perf/slowest_rank"] == 0.0
    assert metrics["perf/data_wait_max_rank"] == 1.0
    assert summary["ranks"][1]["data"] / summary["ranks"][1]["seconds"] > 0.3
    assert 0.0 < metrics["perf/mfu_measured"] <= 1.0
    assert metrics["perf/tokens_per_sec"] == pytest.approx(64 * metrics["perf/samples_per_sec"])
    assert summary["ranks"][0]["batches"] == 19  # every batch but the first
    for rank in (0, 1):
        trace = json.loads(gzip.decompress((run_dir / "perf" / f"trace-rank{rank}.json.gz").read_bytes()))
        assert any("aten::mm" in event.get("name", "") for event in trace["traceEvents"])
    assert "rank 1: profiler trace of steps 4-5" in result.stdout
