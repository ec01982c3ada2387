"""Reaches into private names of Lightning, torch and DeepSpeed that have no public alternative.

Each function names the private attribute it depends on and fails loudly (``CompatError``, naming the reach)
when an upgrade removes it, rather than silently doing nothing; ``tests/test_compat.py`` has a test per reach.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from lightning_mlopt.exceptions import CompatError


def _require(owner: Any, name: str, what: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        raise CompatError(
            f"{what}: {type(owner).__name__}.{name} is gone in this version; lightning_mlopt needs an update"
        ) from None


def keep_lightning_off_signals(trainer: Any, signums: Iterable[int]) -> None:
    """Keep our handlers for ``signums`` when Lightning registers its own in ``Trainer._run``.

    Reach: ``trainer._signal_connector.register_signal_handlers`` (Lightning 2.x). Lightning installs, after the
    callbacks' ``setup``, a SIGTERM handler that runs ``dist.broadcast`` inside the handler (a signal landing
    mid-step puts the ranks in different collectives: a hang) and, under SLURM, a SIGUSR1 handler that saves a
    checkpoint inside the handler. Lightning's registration still runs (its bookkeeping for other signals stays
    right); ours are put back at once, with the signals blocked meanwhile so none reaches Lightning's handler.
    """
    owned = sorted(set(signums))
    connector = _require(trainer, "_signal_connector", "keeping our preemption handlers")
    register: Callable[[], None] = _require(connector, "register_signal_handlers", "keeping our preemption handlers")
    if not owned or getattr(register, "_keeps_signals", None) == owned:
        return

    def register_keeping_ours() -> None:
        ours = {number: signal.getsignal(number) for number in owned}
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, owned)
        try:
            register()
            for number, handler in ours.items():
                signal.signal(number, handler)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a signal that came meanwhile reaches ours now

    register_keeping_ours._keeps_signals = owned  # type: ignore[attr-defined]
    connector.register_signal_handlers = register_keeping_ours


@contextlib.contextmanager
def deepspeed_initialize_on_rank(device_rank: int) -> Iterator[None]:
    """Within the block, ``deepspeed.initialize`` gets ``args.device_rank = device_rank`` whatever it is passed.

    Reach: Lightning's ``DeepSpeedStrategy._initialize_deepspeed_inference`` (validate/test/predict) passes
    ``device_rank=self.root_device.index``, which is None on CPU; DeepSpeed then fails comparing None with an
    int. Wrapping the module attribute it looks up at call time extends that method instead of copying it.
    """
    import deepspeed

    original = _require(deepspeed, "initialize", "DeepSpeed inference on CPU")

    def initialize(*args: Any, **kwargs: Any) -> Any:
        kwargs["args"] = argparse.Namespace(device_rank=device_rank)
        return original(*args, **kwargs)

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def preload_checkpoint(trainer: Any, path: Any, checkpoint: dict[str, Any]) -> None:
    """Hand Lightning a checkpoint we loaded ourselves, as ``CheckpointConnector.resume_start`` would load it.

    Reaches ``trainer._checkpoint_connector._ckpt_path`` and ``._loaded_checkpoint`` (what ``resume_start``
    sets) and Lightning's checkpoint migration. Used for single-file checkpoints, loaded memory-mapped after
    verification (one read of the disk; ranks on one machine share the pages) under the pickle allowlist.
    """
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

    connector = _require(trainer, "_checkpoint_connector", "preloading a checkpoint")
    _require(connector, "_loaded_checkpoint", "preloading a checkpoint")
    _require(connector, "_ckpt_path", "preloading a checkpoint")
    connector._ckpt_path = path
    connector._loaded_checkpoint = _pl_migrate_checkpoint(checkpoint, path)
