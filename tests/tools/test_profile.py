"""``python -m lightning_mlopt profile``: its arithmetic, its verdicts on real runs, and its bad input."""

from __future__ import annotations

import pytest

from lightning_mlopt.perf.verdict import decide, scaling_efficiency
from lightning_mlopt.tools import profile as tool
from tests.conftest import CONFIGS, failure_report, run_tool_here
from tests.support.preloaded import fork_tools_child_fits


def test_scaling_efficiency_arithmetic():
    assert scaling_efficiency({1: 100.0, 2: 180.0, 4: 300.0}) == {1: 1.0, 2: 0.9, 4: 0.75}
    # Without a 1-process run, per-process throughput is compared with the smallest count's.
    assert scaling_efficiency({2: 200.0, 8: 640.0}) == {2: 1.0, 8: 0.8}
    assert scaling_efficiency({}) == {}


def _summary(samples_per_sec: float, data_wait: float, compute: float = 0.85) -> dict:
    return {
        "stall_threshold": 0.1,
        "metrics": {
            "perf/samples_per_sec": samples_per_sec,
            "perf/frac_data_wait_max": data_wait,
            "perf/data_wait_max_rank": 1.0,
            "perf/frac_forward": compute / 3,
            "perf/frac_backward": compute / 2,
            "perf/frac_optimizer": compute / 6,
        },
    }


def test_verdicts_follow_the_numbers():
    train = _summary(100.0, data_wait=0.02)
    assert decide(train, _summary(110.0, 0.9)).kind == "input-bound"  # the loader barely outruns training
    assert decide(_summary(100.0, data_wait=0.3), _summary(900.0, 0.9)).kind == "input-bound"
    assert decide(train, _summary(900.0, 0.9)).kind == "compute-bound"
    scaled = decide(train, _summary(900.0, 0.9), {1: 1.0, 2: 0.6})
    assert scaled.kind == "communication-bound" and "60% at 2 processes" in str(scaled)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--steps", "1"], "--steps must be >= 2"),
        (["--scaling", "one,two"], "expected process counts"),
        (["--scaling", "2"], "at least two process counts"),
        (["--performance.bogus=1"], "performance.bogus"),
        # A measured run starts (a process) before the constructor refuses: seconds.
        pytest.param(["--performance.profile_steps=[8,4]"], "0 <= start < stop", marks=pytest.mark.slow),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, arguments, message):
    monkeypatch.chdir(tmp_path)
    # A constructor's error (profile_steps) surfaces in the first measured run, whose exit 2 is passed on.
    assert tool.main(["--config", str(CONFIGS / "gpt.yaml"), *arguments]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.ckpt"))


def _profile(tmp_path, monkeypatch, *arguments: str):
    """The tool in this process, its measured fits forked from the preloaded server (their start-up is not measured)."""
    base = ["--config", str(CONFIGS / "gpt.yaml"), "--steps", "8", "--trainer.accelerator=cpu"]
    fork_tools_child_fits(monkeypatch)
    result = run_tool_here("profile", [*base, f"--run_dir={tmp_path / 'run'}", *arguments], tmp_path, monkeypatch)
    assert result.returncode == 0, failure_report(result)
    return result


@pytest.mark.multiprocess
@pytest.mark.solo  # its compute/input verdict is measured: another worker beside it skews it
def test_gpt_demo_is_compute_bound(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    _profile(tmp_path, monkeypatch, "--trainer.devices=2")
    report = (run_dir / "profile.md").read_text()
    assert "**Verdict: compute-bound.**" in report
    assert "| loader-only | 2 |" in report and "| train | 2 |" in report
    assert (run_dir / "profile.png").stat().st_size > 10_000
    assert not (run_dir / "checkpoints").exists()  # measured runs keep to <run_dir>/profile/


@pytest.mark.slow
@pytest.mark.solo  # its data-wait fraction is measured: another worker beside it skews it
def test_slow_dataset_is_input_bound(tmp_path, monkeypatch):
    slow_data = ["--data=tests.support.models.SlowCollateTokens", "--data.collate_sleep_s=0.05"]
    result = _profile(
        tmp_path, monkeypatch, "--trainer.devices=1", *slow_data, "--model.n_layer=1", "--model.d_model=64"
    )
    assert "**Verdict: input-bound.**" in result.stdout
    assert "data wait up to" in (tmp_path / "run" / "profile.md").read_text()
