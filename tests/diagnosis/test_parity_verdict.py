"""The parity verdict says what it compared: under DeepSpeed, losses and parameters, and not the gradients.

ZeRO-2 leaves no ``.grad`` (its engine owns the gradients), so a record holds none; the verdict used to count
the reference's gradients as compared and print ``gradient nan``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, SingleDeviceStrategy

from lightning_mlopt.diagnosis.parity import DEEPSPEED_OWNS_GRADIENTS, ParityRecorder, compare


def _record(gradients: dict[str, torch.Tensor], parameter: float = 0.0, **extra: Any) -> dict[str, Any]:
    parameters = {"w": torch.full((4,), 1.0 + parameter), "b": torch.ones(2)}
    return {"losses": [2.0, 1.5, 1.2], "gradients": gradients, "parameters": parameters, **extra}


REFERENCE = _record({"w": torch.ones(4), "b": torch.ones(2)})


def test_a_deepspeed_record_compares_losses_and_parameters_and_says_why_not_gradients():
    deepspeed = _record({}, parameter=1e-5, gradients_not_recorded=DEEPSPEED_OWNS_GRADIENTS)
    verdict = compare(deepspeed, REFERENCE)
    assert verdict.matches
    assert verdict.summary == (
        "parity: 3 steps match the one-process run (losses and 2 parameters compared; gradients not compared: "
        "DeepSpeed's engine owns them; largest relative difference: parameter 1e-05)"
    )
    assert "nan" not in verdict.summary and "2 gradients" not in verdict.summary


def test_a_diverging_deepspeed_record_names_the_parameter_and_that_gradients_were_not_compared():
    deepspeed = _record({}, parameter=0.5, gradients_not_recorded=DEEPSPEED_OWNS_GRADIENTS)
    verdict = compare(deepspeed, REFERENCE)
    assert not verdict.matches
    assert verdict.summary.splitlines() == [
        "parity: DIVERGES from the one-process run",
        "  first diverging parameter after 3 steps: w (relative difference 0.5, tolerance 0.001)",
        "  gradients not compared: DeepSpeed's engine owns them",
    ]


def test_an_older_record_without_gradients_or_a_reason_is_not_counted_as_compared():
    verdict = compare(_record({}), REFERENCE)
    assert verdict.matches and "gradients not compared: none were recorded;" in verdict.summary


def test_a_record_with_gradients_reads_as_before():
    verdict = compare(_record({"w": torch.ones(4), "b": torch.ones(2)}, gradients_not_recorded=""), REFERENCE)
    assert verdict.summary == (
        "parity: 3 steps match the one-process run (losses, 2 gradients, 2 parameters; largest relative "
        "differences: gradient 0, parameter 0)"
    )


def test_the_recorder_keeps_no_gradients_under_deepspeed_and_records_why(tmp_path):
    model = torch.nn.Linear(4, 4)
    model(torch.ones(2, 4)).pow(2).sum().backward()  # a .grad a DeepSpeed engine would not have reduced
    for name, strategy, reason in (
        ("deepspeed", DeepSpeedStrategy.__new__(DeepSpeedStrategy), DEEPSPEED_OWNS_GRADIENTS),  # no engine needed
        ("plain", SingleDeviceStrategy("cpu"), ""),
    ):
        recorder = ParityRecorder(str(tmp_path / name))
        trainer = SimpleNamespace(strategy=strategy, global_rank=0, world_size=1)
        recorder.setup(trainer, model, "fit")  # type: ignore[arg-type]
        recorder.on_before_optimizer_step(trainer, model, None)  # type: ignore[arg-type]
        assert (recorder.gradients == {}) == bool(reason)
        recorder.on_train_end(trainer, model)  # type: ignore[arg-type]
        record = torch.load(recorder.out_dir / "parity.pt", weights_only=True)
        assert record["gradients_not_recorded"] == reason
        assert set(record["gradients"]) == (set() if reason else {"weight", "bias"})
