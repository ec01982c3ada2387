"""``python -m lightning_mlopt parity``: a configuration against a one-process run of the same model, seed and
data: the tool runs in the test process, its two fits forked from the preloaded server on CPU processes.

A correct 2-process DDP run matches (the reference trains on the global batch of 2 x 16 in one process); a
tensor-parallel plan that passes every static check on a model that is not tensor-parallel-correct (a
``[q; k; v]`` fused projection with a fixed head count in ``view``) is caught, naming the first tensor that
diverges, with exit status 1. Context parallelism (``cp.yaml``) matches. A compiled configuration is compared
with the eager model, float8 left out of both. Bad input ends with 2 before anything runs.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from lightning_mlopt.strategies.tensor.tp_plan import resolve
from tests.conftest import CONFIGS, run_cli, run_tool_here
from tests.support.llama_style import FixedHeadsGPT
from tests.support.preloaded import fork_tools_child_fits

QUIET = ("--trainer.accelerator=cpu", "--trainer.devices=2")


@pytest.mark.multiprocess
def test_a_correct_ddp_run_matches_one_process_on_its_global_batch(tmp_path, monkeypatch):
    fork_tools_child_fits(monkeypatch)
    arguments = ["--config", str(CONFIGS / "gpt.yaml"), "--trainer.strategy=ddp", *QUIET]
    result = run_tool_here("parity", arguments, tmp_path, monkeypatch)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    verdict = result.stdout.strip().splitlines()[-1]
    assert verdict.startswith("parity: 4 steps match the one-process run (losses, ")
    (run_dir,) = (tmp_path / "runs").iterdir()
    saved = yaml.safe_load((run_dir / "parity" / "reference" / "config.yaml").read_text())
    assert saved["data"]["init_args"]["batch_size"] == 2 * 16, "the reference trains on the global batch"
    assert str(saved["trainer"]["devices"]) == "1"


@pytest.mark.slow
def test_a_compiled_run_is_compared_with_the_eager_model_and_float8_is_left_out_of_both(tmp_path, monkeypatch):
    fork_tools_child_fits(monkeypatch)
    features = [str(CONFIGS / "features" / name) for name in ("compile.yaml", "float8.yaml")]
    one = ["--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.devices=1", "--compile.backend=aot_eager"]
    arguments = [
        "--config",
        str(CONFIGS / "gpt.yaml"),
        *[f"--config={path}" for path in features],
        *one,
        "--steps",
        "2",
    ]
    result = run_tool_here("parity", arguments, tmp_path, monkeypatch)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    said = result.stdout.strip().splitlines()
    assert "parity: float8 off in both runs (its activation scales come from each rank's batch)" in said
    assert said[-1].startswith("parity: 2 steps match the one-process run")
    (run_dir,) = (tmp_path / "runs").iterdir()
    saved = [
        yaml.safe_load((run_dir / "parity" / run / "config.yaml").read_text()) for run in ("configured", "reference")
    ]
    assert [config["compile"]["enabled"] for config in saved] == [True, False]
    assert [config["float8"]["enabled"] for config in saved] == [False, False]


@pytest.mark.multiprocess
def test_a_context_parallel_run_matches_one_process(tmp_path, monkeypatch):
    fork_tools_child_fits(monkeypatch)
    cp = ["--config", str(CONFIGS / "strategies" / "cp.yaml")]
    arguments = ["--config", str(CONFIGS / "gpt.yaml"), *cp, *QUIET, "--steps", "3"]
    result = run_tool_here("parity", arguments, tmp_path, monkeypatch)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("parity: 3 steps match the one-process run")


@pytest.mark.multiprocess
def test_a_wrong_plan_that_passes_the_static_check_is_caught(tmp_path, monkeypatch):
    gpt = yaml.safe_load((CONFIGS / "gpt.yaml").read_text())
    resolve(FixedHeadsGPT(**gpt["model"]["init_args"]), FixedHeadsGPT.tp_plan, 2)  # the check finds nothing
    gpt["model"]["class_path"] = "tests.support.llama_style.FixedHeadsGPT"
    (tmp_path / "fixed_heads.yaml").write_text(yaml.safe_dump(gpt))
    fork_tools_child_fits(monkeypatch)
    result = run_tool_here(
        "parity", ["--config", "fixed_heads.yaml", "--trainer.strategy=tp", *QUIET], tmp_path, monkeypatch
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout
    assert "parity: DIVERGES from the one-process run" in out
    assert "first diverging gradient at the first step: model." in out
    assert len(out.strip().splitlines()) <= 8


def test_bad_input_ends_before_anything_runs(tmp_path):
    result = run_cli(["parity", "--config", str(CONFIGS / "gpt.yaml"), "--steps", "0"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --steps must be >= 1, got 0"
    assert not (tmp_path / "runs").exists()


def test_the_recorded_gradients_are_copies_that_clipping_cannot_change(tmp_path):
    # An fp32 CPU gradient's .float().cpu() is the gradient itself: recorded as such, clipping (in place, after
    # the hook) rewrote the record, and a TP run, whose split gradients are gathered into new tensors, looked
    # diverged wherever clipping was active.
    from lightning_mlopt.diagnosis.parity import ParityRecorder

    model = torch.nn.Linear(4, 4)
    model(torch.ones(2, 4)).pow(2).sum().backward()
    recorder = ParityRecorder(str(tmp_path))
    recorder.on_before_optimizer_step(None, model, None)  # type: ignore[arg-type]  # reads the module only
    recorded = {name: gradient.clone() for name, gradient in (recorder.gradients or {}).items()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert recorded.keys() == {"weight", "bias"}
    for name, gradient in recorded.items():
        assert torch.equal(recorder.gradients[name], gradient), name  # type: ignore[index]


@pytest.mark.multiprocess
def test_a_pipeline_run_matches_one_process_with_every_stages_gradients(tmp_path, monkeypatch):
    overlay = str(CONFIGS / "strategies" / "pp.yaml")
    fork_tools_child_fits(monkeypatch)
    result = run_tool_here(
        "parity", ["--config", str(CONFIGS / "gpt.yaml"), "--config", overlay, *QUIET], tmp_path, monkeypatch
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    verdict = result.stdout.strip().splitlines()[-1]
    # Both stages' gradients and parameters (53 of the 4-layer demo's), gathered over the pipeline.
    assert verdict.startswith("parity: 4 steps match the one-process run (losses, 53 gradients, 53 parameters"), verdict
