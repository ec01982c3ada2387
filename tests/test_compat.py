"""Each reach into a private name (lightning_mlopt/_compat.py) still works with the installed versions."""

from __future__ import annotations

import signal

import pytest

from lightning_mlopt import _compat


def test_lightning_signal_registration_keeps_our_handlers():
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)

    def ours(signum, frame):  # type: ignore[no-untyped-def]
        pass

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, ours)
    try:
        _compat.keep_lightning_off_signals(trainer, [signal.SIGTERM])
        trainer._signal_connector.register_signal_handlers()  # what Trainer._run does after the callbacks' setup
        assert signal.getsignal(signal.SIGTERM) is ours, "Lightning's SIGTERM handler (a collective inside) won"
        trainer._signal_connector.teardown()
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_missing_reach_fails_loudly_naming_it():
    with pytest.raises(_compat.CompatError, match=r"keeping our preemption handlers: object\._signal_connector"):
        _compat.keep_lightning_off_signals(object(), [signal.SIGTERM])


def test_deepspeed_initialize_is_wrapped_only_inside_the_block():
    import deepspeed

    original = deepspeed.initialize
    seen = {}

    with _compat.deepspeed_initialize_on_rank(3):
        assert deepspeed.initialize is not original
        deepspeed_initialize = deepspeed.initialize
    assert deepspeed.initialize is original

    def fake(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.update(kwargs)

    deepspeed.initialize = fake
    try:
        with _compat.deepspeed_initialize_on_rank(3):
            deepspeed.initialize(args=None, model=None)
    finally:
        deepspeed.initialize = original
    assert seen["args"].device_rank == 3 and callable(deepspeed_initialize)


def test_a_preloaded_checkpoint_is_what_lightning_restores_from():
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)
    checkpoint = {"epoch": 3, "global_step": 7, "pytorch-lightning_version": pl.__version__, "state_dict": {}}
    _compat.preload_checkpoint(trainer, "/ckpt/state.ckpt", checkpoint)
    assert trainer._checkpoint_connector._ckpt_path == "/ckpt/state.ckpt"
    assert trainer._checkpoint_connector._loaded_checkpoint["global_step"] == 7
