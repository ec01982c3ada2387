"""Counting, on a CPU, the host reads of tensors that would live on the GPU: the device synchronisations of a step.

On a GPU, ``loss.item()`` (or ``float``, ``bool``, ``tolist``, ``.cpu()``, ``.numpy()``) waits for every kernel
queued before it: the host stops queueing the next step's work, and the GPU idles until it does. On a CPU nothing
waits, and the model's tensors and the host's live in the same memory, so such a read cannot be seen by timing.
It can be seen by provenance: :class:`DeviceTaint` marks every tensor computed from the model's parameters or
a batch (a dispatch mode that follows every operation, in place ones and views included, through the storages
they write), and :class:`HostReads` counts the reads of marked tensors, each with the line that made it. A
value the host made itself (a timer, a flag, a count) is never marked: reading it costs nothing on a GPU either.
One read a CPU cannot tell apart is left to the GPU test (``set_sync_debug_mode("error")``): ``.to("cpu")``, since
on a CPU "the device" is "cpu" too and ``.to(device)`` is spelled the same way.

:class:`CountHostReads` runs both through a real fit, from the first batch to the end of training, and writes
``host-reads-rank<N>.json``: per step, the reads and whether the step logged (a logger was called) or printed
(the progress bar read its metrics).

Example::

    --trainer.callbacks+=tests.support.host_reads.CountHostReads --trainer.callbacks.out_dir=/tmp/reads
"""

from __future__ import annotations

import json
import os
import traceback
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from typing_extensions import override

from lightning_mlopt.demos import GPTLanguageModel

# The Python-level ways a tensor's value reaches the host; each is a device synchronisation on a GPU.
READS = frozenset(
    {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__format__", "cpu", "numpy", "__array__"}
)
_OWN_FILES = (os.sep + os.path.join("torch", ""), __file__, os.sep + "typing_extensions")


class DeviceTaint(TorchDispatchMode):
    """Marks the storage of every tensor computed, by any operation, from an already marked tensor.

    Storages rather than tensor objects: ``param.data``, a view or an in-place copy is a new Python object on
    the same memory. A storage's mark goes with it (a weak reference), so memory reused by a host tensor later
    is not mistaken for device memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref] = {}
        self._wrappers: dict[int, weakref.ref] = {}

    def mark(self, value: Any) -> None:
        """Mark every tensor in ``value`` (a tensor, or a nest of lists, tuples and dicts)."""
        for tensor in _tensors(value):
            if is_traceable_wrapper_subclass(tensor):  # DTensor and the like: the wrapper and what it wraps
                self._wrappers[id(tensor)] = weakref.ref(tensor, _forget(self._wrappers, id(tensor)))
                inner, _ = tensor.__tensor_flatten__()
                self.mark([getattr(tensor, name) for name in inner])
                continue
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = id(storage)
            if key not in self._storages:
                self._storages[key] = weakref.ref(storage, _forget(self._storages, key))

    def marked(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` was computed from the model's state or a batch."""
        if is_traceable_wrapper_subclass(tensor):
            ref = self._wrappers.get(id(tensor))
            if ref is not None and ref() is tensor:
                return True
            inner, _ = tensor.__tensor_flatten__()
            return any(self.marked(getattr(tensor, name)) for name in inner)
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return False
        ref = self._storages.get(id(storage))
        return ref is not None and ref() is storage

    @override
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(self.marked(tensor) for tensor in _tensors((args, kwargs))):
            self.mark(out)
            if func._schema.is_mutable:  # an in-place op or an out= variant: the written inputs too
                for argument, value in zip(func._schema.arguments, args, strict=False):
                    if argument.alias_info is not None and argument.alias_info.is_write:
                        self.mark(value)
        return out


class HostReads(TorchFunctionMode):
    """Counts the reads of marked tensors into host values, each with the line outside torch that made it."""

    def __init__(self, taint: DeviceTaint) -> None:
        super().__init__()
        self.taint = taint
        self.reads: list[dict[str, str]] = []

    @override
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS and args and isinstance(args[0], torch.Tensor) and self.taint.marked(args[0]):
            self.reads.append({"read": name, "site": _caller()})
        return func(*args, **(kwargs or {}))


class CountHostReads(pl.Callback):
    """Counts, per training step, the host reads of tensors computed from the model or the batch.

    A step runs from its batch's ``on_train_batch_start`` to the next one's: every hook, the loop's logging
    and the progress bar's drawing included. The count starts at the first batch (the model's parameters and
    buffers, then each batch, are the marked seeds) and stops at the end of training. ``torch.cuda``'s
    ``synchronize`` calls are counted too (none is expected on a CPU; a call would be one on a GPU).

    Args:
        out_dir: folder for ``host-reads-rank<N>.json``.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.steps: list[dict[str, Any]] = []
        self._taint: DeviceTaint | None = None
        self._reads: HostReads | None = None
        self._step: dict[str, Any] | None = None
        self._restore: list[tuple[Any, str, Any]] = []

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[override]
        if self._taint is None:
            self._start(trainer, pl_module)
        assert self._taint is not None and self._reads is not None
        self._close_step()
        self._taint.mark(batch)
        self._step = {"step": trainer.global_step, "logged": False, "printed": False}
        self._reads.reads = []

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._taint = DeviceTaint()
        self._taint.mark([*pl_module.parameters(), *pl_module.buffers()])
        for optimizer in trainer.optimizers:
            self._taint.mark([state for state in optimizer.state.values()])
        self._reads = HostReads(self._taint)
        for logger in trainer.loggers:
            self._watch(logger, "log_metrics", "logged")
        bar = trainer.progress_bar_callback
        if bar is not None:
            self._watch(bar, "get_metrics", "printed")
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize")):
            self._watch(owner, name, "synchronize")
        self._taint.__enter__()
        self._reads.__enter__()

    def _watch(self, owner: Any, name: str, flag: str) -> None:
        """Wrap ``owner.name`` to flag the current step when it is called (``synchronize``: count it as a read)."""
        original = getattr(owner, name)
        # A module or class gets its function back; an instance loses the attribute set on it.
        self._restore.append((owner, name, original if isinstance(owner, (type, ModuleType)) else None))

        def watched(*args: Any, **kwargs: Any) -> Any:
            if self._step is not None:
                if flag == "synchronize":
                    assert self._reads is not None
                    self._reads.reads.append({"read": f"torch.cuda {name}", "site": _caller()})
                else:
                    self._step[flag] = True
            return original(*args, **kwargs)

        setattr(owner, name, watched)

    def _close_step(self) -> None:
        if self._step is not None and self._reads is not None:
            self.steps.append({**self._step, "reads": self._reads.reads})
            self._step = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_step()
        if self._reads is not None and self._taint is not None:
            self._reads.__exit__(None, None, None)
            self._taint.__exit__(None, None, None)
        for owner, name, original in reversed(self._restore):
            if original is not None:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"log_every_n_steps": trainer.log_every_n_steps, "steps": self.steps}
        (self.out_dir / f"host-reads-rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _forget(table: dict[int, weakref.ref], key: int) -> Any:
    def forget(_: Any) -> None:
        table.pop(key, None)

    return forget


def _caller() -> str:
    """``path:line function < path:line function`` of the innermost frame outside torch and this module, and
    the frame that called it (a helper such as ``to_item`` says little alone)."""
    frames = [frame for frame in traceback.extract_stack()[:-2] if not any(p in frame.filename for p in _OWN_FILES)]
    return " < ".join(f"{_short(frame.filename)}:{frame.lineno} {frame.name}" for frame in frames[-1:-3:-1]) or "?"


def _short(filename: str) -> str:
    for root in ("site-packages" + os.sep, "lightning_mlopt" + os.sep, "tests" + os.sep):
        if root in filename:
            head = "lightning_mlopt/" if root.startswith("lightning_mlopt") else "tests/" if root == "tests/" else ""
            return head + filename.split(root, 1)[1]
    return filename


class GPTWithBarMetrics(GPTLanguageModel):
    """A user's model: the GPT demo, also logging a metric of its own with ``prog_bar=True`` at every step."""

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("user/perplexity", loss.detach().exp(), prog_bar=True)
        return loss
