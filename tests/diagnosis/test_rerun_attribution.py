"""Rerun attribution in GradNormMonitor: a bad step re-run with the same inputs and RNG state is classified."""

from __future__ import annotations

import pytest
import torch

from lightning_mlopt.diagnosis import inject
from lightning_mlopt.diagnosis.rerun import capture_torch_rng, classify, rerun_step
from tests.conftest import failure_report, run_cli
from tests.support.cli_args import QUIET, fit_args

NAN = float("nan")


def test_classification_follows_what_the_rerun_reproduced():
    hosts = ["a", "b"]
    assert classify("nonfinite", [1.0, NAN], [1.0, NAN], [None, None], hosts)[0] == "reproducible"
    label, why = classify("nonfinite", [1.0, NAN], [1.0, 1.1], [None, None], hosts)
    assert label == "transient" and "rank 1 (host b)" in why
    # Born in backward: the losses were finite; the re-run backward decides where it could run.
    assert classify("nonfinite", [1.0, 1.1], [1.0, 1.1], [True, False], hosts)[0] == "reproducible"
    assert classify("nonfinite", [1.0, 1.1], [1.0, 1.1], [True, True], hosts)[0] == "transient"
    assert classify("nonfinite", [1.0, 1.1], [1.0, 1.1], [None, None], hosts)[0] == "unclassified"
    assert classify("spike", [9.0, 1.1], [9.0, 1.1], [None, None], hosts)[0] == "reproducible"
    assert classify("spike", [9.0, 1.1], [1.2, 1.1], [None, None], hosts)[0] == "transient"


def test_a_rerun_reproduces_dropout_and_leaves_the_rng_and_gradients_alone():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = module

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.net(batch).sum()

        def log(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            pass

    step, batch = Step(), torch.ones(2, 4)
    rng = capture_torch_rng()
    original = float(step.training_step(batch, 0).detach())
    after_step = torch.get_rng_state()
    rerun = rerun_step(step, batch, 0, rng, with_backward=True)
    assert rerun.loss == original and rerun.gradients_finite is True
    assert torch.equal(torch.get_rng_state(), after_step)  # training's RNG goes on untouched
    assert all(param.grad is None for param in step.parameters())


def test_the_first_module_with_a_non_finite_output_is_named():
    from lightning_mlopt.diagnosis.rerun import first_nonfinite_output

    class Log(torch.nn.Module):
        def forward(self, x):  # type: ignore[no-untyped-def]
            return torch.log(x)  # log of a negative number: NaN born here

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Linear(4, 4)
            self.bad = Log()
            self.head = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.head(self.bad(self.scale(batch) - 100.0)).sum()

        def log(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("a diagnosis logs nothing")

    index, names = first_nonfinite_output(Step(), torch.ones(2, 4), 0)
    assert names == ["scale", "bad", "head"] and names[index - 1] == "bad"


@pytest.mark.multiprocess
def test_a_one_time_nan_is_transient_and_skip_trains_on(tmp_path):
    result = run_cli(
        fit_args(
            "--model.n_layer=1",
            "--model.d_model=64",
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.callbacks+=lightning_mlopt.callbacks.GradNormMonitor",
            "--trainer.callbacks.on_nonfinite=skip",
            steps=10,
            run_dir=tmp_path / "run",
        ),
        cwd=tmp_path,
        preloaded=True,
        env={inject.ENV: "nan:rank=1,step=7,module=layers.0.mlp"},
    )
    assert result.returncode == 0, failure_report(result)
    assert "non-finite values at step 7" in result.stderr
    assert "rerun (same micro-batch, same RNG state): transient on rank 1 (host " in result.stderr
    assert "skipping this optimizer step" in result.stderr


@pytest.mark.multiprocess
def test_a_nan_from_a_bad_sample_is_reproducible(tmp_path):
    config = tmp_path / "bad_sample.yaml"
    config.write_text("model:\n  class_path: tests.support.models.NaNSampleRegression\n")
    arguments = ["fit", "--config", str(config), "--trainer.accelerator=cpu", "--trainer.devices=2"]
    arguments += ["--trainer.max_steps=8", f"--run_dir={tmp_path / 'run'}", *QUIET]
    arguments += ["--trainer.callbacks+=lightning_mlopt.callbacks.GradNormMonitor"]
    arguments += ["--trainer.callbacks.on_nonfinite=skip", "--trainer.callbacks.depth=0"]
    result = run_cli(arguments, cwd=tmp_path, preloaded=True)  # what training computes: imports paid once
    assert result.returncode == 0, failure_report(result)
    assert "rerun (same micro-batch, same RNG state): reproducible on rank " in result.stderr
    assert "non-finite again (the data or the model)" in result.stderr
