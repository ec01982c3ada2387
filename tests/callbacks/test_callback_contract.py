"""What every callback of ours promises, checked the same way for each.

Constructible from YAML (the CLI's parser accepts it with its defaults), picklable (Lightning's spawn
launchers and checkpointing of hyperparameters pickle callbacks), usable for two fits in a row, a
``state_dict`` that survives a JSON round trip into a fresh instance, and no threads left running after fit.
"""

from __future__ import annotations

import json
import pickle
import threading

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mlopt import callbacks
from lightning_mlopt.callbacks import (
    CompileModel,
    FaultTolerantCheckpoint,
    Float8Training,
    Resume,
    ThroughputProgressBar,
)
from lightning_mlopt.cli.check import check_arguments
from tests.conftest import CONFIGS

# Every public callback, discovered: a new one is held to the contract without editing this file.
CALLBACKS = [
    value
    for name in callbacks.__all__
    if isinstance(value := getattr(callbacks, name), type)
    and issubclass(value, pl.Callback)
    and not name.startswith("_")
]


def test_every_public_callback_is_discovered():
    names = {cls.__name__ for cls in CALLBACKS}
    assert {"FaultTolerantCheckpoint", "GradNormMonitor", "NCCLHealthCheck", "PerformanceMonitor"} <= names
    assert {"ReplicaConsistencyCheck", "ThroughputProgressBar"} <= names


@pytest.mark.parametrize("callback_class", CALLBACKS, ids=lambda cls: cls.__name__)
def test_constructible_from_yaml(callback_class):
    path = f"{callback_class.__module__.rsplit('.', 1)[0]}.{callback_class.__name__}"
    config = check_arguments(["--config", str(CONFIGS / "quickstart.yaml"), f"--trainer.callbacks+={path}"])
    assert config.trainer.callbacks[-1].class_path == path


@pytest.mark.parametrize("callback_class", CALLBACKS, ids=lambda cls: cls.__name__)
def test_picklable_and_state_survives_a_round_trip(callback_class):
    callback = pickle.loads(pickle.dumps(callback_class()))
    state = json.loads(json.dumps(callback.state_dict()))
    fresh = callback_class()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    fresh.load_state_dict({})  # a checkpoint from before the callback existed still loads


@pytest.mark.parametrize("callback_class", CALLBACKS, ids=lambda cls: cls.__name__)
def test_two_fits_in_a_row_and_no_threads_left(tmp_path, callback_class):
    # The second fit raises max_steps: the checkpoint callback resumes from the first fit's final checkpoint,
    # which (resume.final) it continues rather than keeping finished.
    kwargs: dict[str, object] = {}
    if callback_class is FaultTolerantCheckpoint:
        kwargs = {"dirpath": str(tmp_path / "checkpoints"), "resume": Resume(final=True)}
    if callback_class is Float8Training:  # BoringModel's one linear (32 x 2) is too narrow for float8 matmuls
        kwargs = {"enabled": False}
    if callback_class is CompileModel:  # BoringModel has no block stack; dynamo's tracing without a compiler
        kwargs = {"regions": "model", "backend": "eager"}
    callback = callback_class(**kwargs)
    before = {thread.ident for thread in threading.enumerate()}
    for max_steps in (2, 4):  # the second fit continues (or, for the checkpoint callback, resumes)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=max_steps,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=callback_class is FaultTolerantCheckpoint,
            enable_progress_bar=callback_class is ThroughputProgressBar,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            callbacks=[callback],
        )
        trainer.fit(BoringModel())
        assert trainer.global_step == max_steps
    # tqdm keeps one monitor thread per process for all its bars (a library singleton, not ours).
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    left = [name for name in left if name != "tqdm_monitor"]
    assert not left, f"threads still running after fit: {left}"
