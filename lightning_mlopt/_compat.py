# long: the catalogue of every private reach, one small function each, so none hides elsewhere
"""Reaches into private names of Lightning, torch, DeepSpeed, argparse and the interpreter with no public alternative.

Each function names the private attribute it depends on and fails loudly (``CompatError``, naming the reach)
when an upgrade removes it, rather than silently doing nothing; ``tests/test_compat.py`` has a test per reach.
Nothing outside this module reaches a private name of another package: ``tests/test_structure.py`` scans for any.

The reaches:

- Lightning: ``Trainer._signal_connector`` (keeping our signal handlers), ``Trainer._checkpoint_connector``
  (``dump_checkpoint``: the state a save writes; ``resume_start``, ``_ckpt_path``, ``_loaded_checkpoint``:
  resuming from a checkpoint we loaded or checked ourselves), ``fit_loop._data_fetcher`` and
  ``fit_loop._combined_loader`` (repositioning a resumed epoch), the data fetcher's ``_start_profiler`` (where
  a batch's fetch starts: PerformanceMonitor's data wait), checkpoint migration,
  ``Callback._generate_state_key`` (callbacks' state keys), the logger connector's per-batch conversion of
  progress-bar metrics (deferred to when the bar reads them), the epoch loop's ``_batches_that_stepped`` (the
  step Lightning labels a batch's row with), ``LightningCLI._parser`` (the resolved config),
  strategies' ``_timeout``, ``_setup_distributed``/``_init_deepspeed_distributed`` and ``_device_mesh`` (process
  group and mesh set-up on CPU), ``DeepSpeedStrategy._restore_zero_state`` and ``_auto_select_batch_size``,
  ``WandbLogger._wandb_init``/``_experiment``/``_id`` (one W&B run per run directory), the loggers behind
  ``rank_zero_info`` (asking ``fit_loop.done`` without its "`Trainer.fit` stopped" line).
- DeepSpeed: ``deepspeed.initialize`` wrapped during inference set-up on CPU; the ZeRO optimizers' groups, fp32
  partitions and the lazy link of their per-parameter optimizer state (a full state loaded); ZeRO-3's start-of-step hook
  (``parameter_offload.fwd_pre_hook``: a step starts at the outermost call of the root module); the torch backend's
  ``deepspeed.comm.torch.build_shm_op`` (its CPU shared-memory op, which ZeRO never calls, neither built nor loaded).
- torch: torchrun's ``_terminate_process_handler`` (``launch`` learns which signal stopped the agent) and
  ``SubprocessHandler.close``/``_stdout``/``_stderr`` (a signal to each worker, not its DataLoader workers),
  ``nn.modules.batchnorm._NormBase`` (per-rank running statistics), the fused ``torch._foreach_*``
  kernels (norms of many tensors in one call), ``torch.autograd._profiler_enabled`` (no collective left in
  flight under a profiler), DCP's whole-folder reader (a checkpoint converted without a temporary file), the
  default store of
  ``torch.distributed`` (the hang watchdog's liveness check), the composable activation checkpoint, the FLOP
  counter's dispatch and the dispatcher's op table (counting runs each op's own kernel, not its decomposition),
  dynamo's compilation callbacks (``torch._dynamo.callback.callback_handler``: what torch.compile costs).
- argparse: a parser's ``_actions`` and subcommand parsers (every known key, for "did you mean").
- the interpreter: ``sys._current_frames`` (the hang dump's stacks), ``atexit._run_exitfuncs`` (exit
  handlers before leaving without C++ destructors).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import logging
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from types import FrameType, ModuleType
from typing import Any

from lightning_mlopt.exceptions import CompatError


def _require(owner: Any, name: str, what: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        owner_name = owner.__name__ if isinstance(owner, ModuleType) else type(owner).__name__
        raise CompatError(
            f"{what}: {owner_name}.{name} is gone in this version; lightning_mlopt needs an update"
        ) from None


def loss_scale(trainer: Any) -> Any:
    """The GradScaler's current scale, a device tensor, under fp16 AMP; None without a scaler (or before it scaled).

    Reach: ``GradScaler._scale``; its public ``get_scale()`` reads it to the host, a device sync every step.
    """
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return _require(scaler, "_scale", "reading the fp16 loss scale")


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


def skip_per_batch_sigterm_broadcast(trainer: Any) -> bool:
    """Drop the SIGTERM flag broadcast Lightning runs at the start of every training batch; True if there was one.

    Lightning 2.6 broadcasts ``trainer.received_sigterm`` from rank 0 before each batch (a collective, and on a
    GPU a device-to-host sync, every step: Lightning issue #21487). Only Lightning's own SIGTERM handler sets
    that flag; where ours owns SIGTERM (:func:`keep_lightning_off_signals`) it is always 0, and the step-boundary
    exchange already carries the signal to every rank. Reach: ``trainer.fit_loop.epoch_loop
    ._broadcast_sigterm_tensor`` (Lightning >= 2.6; earlier versions have no broadcast, nothing to skip).
    """
    loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(loop, "_broadcast_sigterm_tensor", None)):
        return False
    loop._broadcast_sigterm_tensor = _no_broadcast
    return True


def fit_loop_done_quietly(trainer: Any) -> bool:
    """``trainer.fit_loop.done``, without the "`Trainer.fit` stopped: ..." line it logs each time it is asked.

    Lightning asks it itself as the loop ends (or is skipped, on a resume at ``max_steps``) and says why then; a
    callback asking again said the line twice. Reach: the loggers behind ``rank_zero_info`` (Lightning's and
    Fabric's ``utilities.rank_zero``; whichever imported last writes), silenced while it is asked.
    """
    loggers = [logging.getLogger(f"lightning.{part}.utilities.rank_zero") for part in ("pytorch", "fabric")]
    before = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        return bool(trainer.fit_loop.done)
    finally:
        for logger, disabled in zip(loggers, before, strict=True):
            logger.disabled = disabled


def _no_broadcast() -> None:
    """What replaces Lightning's per-batch SIGTERM broadcast: nothing (see skip_per_batch_sigterm_broadcast)."""


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


@contextlib.contextmanager
def deepspeed_without_shm_op() -> Iterator[None]:
    """Within the block, DeepSpeed's torch backend starts without its CPU shared-memory all-reduce op.

    Reach: ``deepspeed.comm.torch.build_shm_op`` (DeepSpeed 0.14+), which ``TorchBackend.__init__`` looks up at
    call time. On DeepSpeed's CPU accelerator it JIT-compiles ``deepspeed_shm_comm`` (the first time on a machine),
    loads it, and prints "... built successfully" in every rank. None is DeepSpeed's own answer where the op is
    unavailable: ``inference_all_reduce``, its only user, then calls the process group's all-reduce.
    """
    backend = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` the attribute is torch itself
    original = _require(backend, "build_shm_op", "starting DeepSpeed's CPU backend without its shared-memory op")
    setattr(backend, "build_shm_op", _no_shm_op)  # noqa: B010 -- set on a module imported by name
    try:
        yield
    finally:
        setattr(backend, "build_shm_op", original)  # noqa: B010


def _no_shm_op() -> None:
    """What replaces DeepSpeed's ``build_shm_op`` in ``deepspeed_without_shm_op``: no op."""


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


def loaded_checkpoint(trainer: Any) -> dict[str, Any] | None:
    """The checkpoint Lightning loaded and is about to restore from (None when none), to adjust before it does.

    Reach: ``trainer._checkpoint_connector._loaded_checkpoint``.
    """
    connector = _require(trainer, "_checkpoint_connector", "reading the loaded checkpoint")
    loaded: dict[str, Any] | None = _require(connector, "_loaded_checkpoint", "reading the loaded checkpoint")
    return loaded or None


def dump_checkpoint(trainer: Any, weights_only: bool = False) -> dict[str, Any]:
    """The state ``trainer.save_checkpoint`` would write, as a dict (no public way to get it without writing).

    Reach: ``trainer._checkpoint_connector.dump_checkpoint``.
    """
    connector = _require(trainer, "_checkpoint_connector", "saving a checkpoint")
    dump: Callable[..., dict[str, Any]] = _require(connector, "dump_checkpoint", "saving a checkpoint")
    return dump(weights_only=weights_only)


def resume_start(trainer: Any, path: Any, weights_only: bool) -> None:
    """Load ``path`` through the strategy as Lightning's ``fit(ckpt_path=...)`` would, before the fit starts.

    Reach: ``trainer._checkpoint_connector.resume_start``.
    """
    connector = _require(trainer, "_checkpoint_connector", "resuming from a checkpoint")
    _require(connector, "resume_start", "resuming from a checkpoint")(path, weights_only=weights_only)


def log_this_steps_metrics(trainer: Any) -> None:
    """Hand this training batch's logged metrics to the loggers now (on a logging step, as Lightning would).

    Lightning does it once the batch's ``on_train_batch_end`` hooks have run. A run that stops inside those
    hooks (a preemption save, then exit) never gets there, and the batch's row would reach no logger.
    Reach: ``trainer._logger_connector.update_train_step_metrics``.
    """
    connector = _require(trainer, "_logger_connector", "logging the stopping step's metrics")
    _require(connector, "update_train_step_metrics", "logging the stopping step's metrics")()


def lightning_row_step(trainer: Any) -> int:
    """The step Lightning labels this training batch's logged row with: batches that stepped before it.

    Lightning logs a batch's row before it counts the batch (``global_step`` has already counted the update):
    a callback row labelled ``global_step`` lands one step after Lightning's row of the same batch, so at a
    resume step one tracker drops a row and another shows two. Reach: ``fit_loop.epoch_loop._batches_that_stepped``.
    """
    return int(_require(trainer.fit_loop.epoch_loop, "_batches_that_stepped", "labelling a logged row"))


def defer_progress_bar_scalars() -> None:
    """Keep ``prog_bar`` metrics as tensors until something reads ``trainer.progress_bar_metrics``.

    Lightning turns every metric logged with ``prog_bar=True`` into a Python number after every batch (its
    logger connector's ``on_batch_end``, through ``_ResultCollection.metrics``): on a GPU, ``.item()`` per
    metric and step, each a device synchronisation that stops the host queueing the next step. Only a progress
    bar reads those numbers, and ours does it only on the steps it draws. After this call the per-batch
    bookkeeping keeps the (detached) tensors, and ``trainer.progress_bar_metrics`` converts them when read, so
    every reader still gets Python numbers. Process-wide and idempotent; nothing else changes.

    Reach: ``logger_connector.result.convert_tensors_to_scalars`` (used there for the ``pbar`` values alone)
    and ``logger_connector.logger_connector._LoggerConnector.progress_bar_metrics`` (Lightning 2.x).
    """
    from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector, result

    what = "reading progress-bar metrics only when the bar draws"
    if getattr(_require(result, "convert_tensors_to_scalars", what), "_keeps_tensors", False):
        return
    connector = _require(logger_connector, "_LoggerConnector", what)
    stored = _require(connector, "progress_bar_metrics", what)
    if not isinstance(stored, property) or stored.fget is None:
        raise CompatError(f"{what}: _LoggerConnector.progress_bar_metrics is no longer a property")
    read_stored = stored.fget

    def keep_tensor(value: Any) -> Any:
        return value

    keep_tensor._keeps_tensors = True  # type: ignore[attr-defined]

    def progress_bar_metrics(self: Any) -> dict[str, Any]:
        return convert_tensors_to_scalars(read_stored(self))

    result.convert_tensors_to_scalars = keep_tensor  # type: ignore[assignment]
    connector.progress_bar_metrics = property(progress_bar_metrics, doc=stored.__doc__)


def epoch_loaders(trainer: Any) -> tuple[Any, Any]:
    """The fit loop's data fetcher and combined loader of the current epoch (None before they exist).

    Reach: ``trainer.fit_loop._data_fetcher`` and ``._combined_loader``: the loop's own record of where the
    epoch is, which a resumed run repositions.
    """
    loop = trainer.fit_loop
    what = "resuming in the middle of an epoch"
    return _require(loop, "_data_fetcher", what), _require(loop, "_combined_loader", what)


def reopen_last_epoch(checkpoint: dict[str, Any]) -> None:
    """In a checkpoint's loop state, count its last epoch as started, not completed (it stopped mid-epoch).

    Reach: the layout of Lightning's ``checkpoint["loops"]["fit_loop"]`` (``epoch_progress``: ``total`` and
    ``current`` trackers) and the checkpoint's ``epoch``, Lightning 2.x: what a save inside the epoch holds.
    """
    progress = _fit_loop_state(checkpoint, "epoch_progress")
    for tracker in (progress["total"], progress["current"]):
        tracker["processed"] -= 1
        tracker["completed"] -= 1
    checkpoint["epoch"] = progress["current"]["completed"]


def start_next_epoch_afresh(checkpoint: dict[str, Any]) -> None:
    """In a checkpoint's loop state, count no batch of the epoch in progress (the previous one used up its data).

    Reach: the layout of Lightning's ``checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]`` (``current``
    tracker, ``is_last_batch``), Lightning 2.x: what a save before the next epoch's first batch would hold.
    """
    progress = _fit_loop_state(checkpoint, "epoch_loop.batch_progress")
    progress["current"] = dict.fromkeys(progress["current"], 0)
    progress["is_last_batch"] = False


def _fit_loop_state(checkpoint: dict[str, Any], key: str) -> dict[str, Any]:
    state = checkpoint.get("loops", {}).get("fit_loop", {})
    if key not in state:
        raise CompatError(
            f"continuing a run: the checkpoint's fit_loop has no {key!r}; lightning_mlopt needs an update"
        )
    return state[key]


def data_ends_after_this_batch(fetcher_owner: Any) -> bool:
    """Whether the loop's data has no batch after the one in flight, looking one batch ahead where Lightning does not.

    Lightning's fetcher knows it (``done``) for a loader with a length, and for one without by prefetching a
    batch. Where a ``limit_*_batches`` gives an unsized loader a length, it counts to the limit and learns of
    an earlier end only when a fetch fails, too late for the other ranks: then the next batch is fetched here,
    into the fetcher's own prefetch slot, and the fetcher prefetches from then on, so it knows. Reach:
    ``_data_fetcher`` (``length``, ``done``, ``batches``; the base fetcher's ``__next__``), Lightning 2.x.
    """
    from lightning.pytorch.loops.fetchers import _DataFetcher, _PrefetchDataFetcher

    fetcher = _require(fetcher_owner, "_data_fetcher", "seeing where each rank's data ends")
    if fetcher.done or fetcher.length is None or fetcher.batches or not isinstance(fetcher, _PrefetchDataFetcher):
        return bool(fetcher.done)
    try:
        fetcher.batches.append(_DataFetcher.__next__(fetcher))
    except StopIteration:
        fetcher.done = True
        return True
    fetcher.length, fetcher.done = None, False  # prefetching keeps `done` from here on
    return False


def end_loop_after_this_batch(fetcher_owner: Any, loop: Any) -> None:
    """End a training epoch or an evaluation run once the batch it is in is done, as if the data ended there.

    ``fetcher_owner`` holds the loop's data fetcher (the fit loop for training, the evaluation loop itself),
    ``loop`` the batch progress (the epoch loop, the evaluation loop). The fetcher is marked exhausted and its
    prefetched batch dropped, so its next fetch raises StopIteration, which ends either loop; the progress's
    ``is_last_batch`` is set, so the step in flight is the epoch's last for everything that asks (the optimizer
    step under gradient accumulation, the epoch-end validation and schedulers). Reach: ``_data_fetcher``, its
    ``done`` and ``batches`` (Lightning 2.x; the next epoch's ``iter()`` resets both).
    """
    fetcher = _require(fetcher_owner, "_data_fetcher", "ending every rank's epoch at the same batch")
    fetcher.done = True
    if isinstance(getattr(fetcher, "batches", None), list):
        fetcher.batches = []
    loop.batch_progress.is_last_batch = True


def mark_dataloader_fetches(trainer: Any, starting: Callable[[], None]) -> bool:
    """Call ``starting`` each time the fit loop asks the training dataloader for a batch; False before it exists.

    Lightning's data fetcher calls ``_start_profiler`` right before ``next()`` on the loaders (its profiler's
    ``train_dataloader_next``); ``starting`` runs there, then Lightning's own. Idempotent per fetcher. Reach:
    ``trainer.fit_loop._data_fetcher._start_profiler`` (Lightning 2.x).
    """
    fetcher = _require(trainer.fit_loop, "_data_fetcher", "marking the dataloader's fetches")
    if fetcher is None:
        return False
    original = _require(fetcher, "_start_profiler", "marking the dataloader's fetches")
    if not isinstance(original, _BeforeFetch):
        fetcher._start_profiler = _BeforeFetch(starting, original)
    return True


class _BeforeFetch:
    """``starting``, then the fetcher's own start-of-fetch hook (see :func:`mark_dataloader_fetches`)."""

    def __init__(self, starting: Callable[[], None], original: Callable[[], None]) -> None:
        self.starting, self.original = starting, original

    def __call__(self) -> None:
        self.starting()
        self.original()


def default_store() -> Any | None:
    """The default process group's key-value store, or None without one.

    Reach: ``torch.distributed.distributed_c10d._get_default_store``.
    """
    import torch.distributed as dist

    get_store = _require(dist.distributed_c10d, "_get_default_store", "the hang watchdog's liveness check")
    try:
        return get_store()
    except (RuntimeError, ValueError):  # no default group
        return None


def current_frames() -> dict[int, FrameType]:
    """Every thread's current frame, by thread id. Reach: ``sys._current_frames`` (documented, underscored)."""
    frames: Callable[[], dict[int, FrameType]] = _require(sys, "_current_frames", "dumping stacks")
    return frames()


def run_exit_handlers() -> None:
    """Run the ``atexit`` handlers now (before ``os._exit``). Reach: ``atexit._run_exitfuncs``."""
    _require(atexit, "_run_exitfuncs", "running the exit handlers")()


def foreach_norm(tensors: list[Any], dtype: Any) -> list[Any]:
    """The L2 norm of each tensor, in one fused kernel per device and dtype. Reach: ``torch._foreach_norm``."""
    import torch

    return list(_require(torch, "_foreach_norm", "computing norms")(tensors, 2.0, dtype=dtype))


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording now. Reach: ``torch.autograd._profiler_enabled``."""
    import torch

    return bool(_require(torch.autograd, "_profiler_enabled", "asking whether a profiler records")())


def foreach_sub(tensors: list[Any], others: list[Any]) -> list[Any]:
    """``tensors[i] - others[i]`` for every i, fused. Reach: ``torch._foreach_sub``."""
    import torch

    return list(_require(torch, "_foreach_sub", "computing update ratios")(tensors, others))


def foreach_mul_(tensors: list[Any], factor: Any) -> None:
    """Multiply every tensor in place by ``factor`` (a tensor), fused. Reach: ``torch._foreach_mul_``."""
    import torch

    _require(torch, "_foreach_mul_", "clipping gradients")(tensors, factor)


def composable_checkpoint() -> Callable[..., Any]:
    """The activation checkpoint of torch, applied to a module in place, keeping parameter names unchanged.

    Reach: ``torch.distributed._composable.checkpoint`` (the wrapper form adds a name prefix).
    """
    import torch.distributed._composable as composable

    return _require(composable, "checkpoint", "activation checkpointing")


def all_to_all_autograd(chunks: Any, group: Any) -> Any:
    """Send ``chunks[i]`` to rank ``i`` of ``group``; ``result[j]`` is what rank ``j`` sent. Differentiable.

    Reach: ``torch.distributed._functional_collectives.all_to_all_single_autograd`` (the public
    ``torch.distributed.nn.functional.all_to_all_single`` is deprecated and refuses torch.compile).
    """
    from torch.distributed import _functional_collectives as funcol

    exchange = _require(funcol, "all_to_all_single_autograd", "context parallelism's all-to-all")
    received = exchange(chunks, None, None, group)
    return received.wait() if hasattr(received, "wait") else received


def flattened_mesh(mesh: Any, names: tuple[str, ...], name: str) -> Any:
    """The dimensions ``names`` of ``mesh`` as one dimension ``name`` (their ranks in row-major order).

    Reach: ``DeviceMesh._flatten`` (torchtitan's ``dp_shard_cp``; no public form yet).
    """
    return _require(mesh[names], "_flatten", "folding the context dimension into FSDP's")(name)


def on_compilations(start: Callable[[str, str], None], end: Callable[[str, str], None]) -> None:
    """Call ``start(trigger, compile_id)`` and ``end(...)`` around each compilation torch.compile runs here.

    ``trigger`` is ``DYNAMO`` (a frame traced and compiled) or ``LAZY_BACKWARD`` (its backward, compiled on first
    use); ``compile_id`` is ``"<frame>/<attempt>"``, an attempt above 0 being a recompilation.
    Reach: ``torch._dynamo.callback.callback_handler`` (no public registration).
    """
    from torch._dynamo import callback

    handler = _require(callback, "callback_handler", "torch.compile's compilation callbacks")
    handler.register_start_callback(lambda args: start(args.callback_trigger.name, str(args.compile_id)))
    handler.register_end_callback(lambda args: end(args.callback_trigger.name, str(args.compile_id)))


def cpu_attention_ops() -> tuple[Any, Any]:
    """The forward and backward aten ops of ``scaled_dot_product_attention`` on CPU (for FLOP formulas).

    Reach: ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``.
    """
    import torch

    return (
        _require(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", "counting attention FLOPs"),
        _require(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", "counting attention FLOPs"),
    )


def raw_flop_formula(formula: Callable[..., int]) -> Callable[..., int]:
    """Mark a FLOP formula for ``FlopCounterMode(custom_mapping=...)`` as taking the tensors, not their shapes.

    Reach: the ``_get_raw`` attribute ``torch.utils.flop_counter`` reads off a custom formula (what its own
    ``register_flop_formula(get_raw=True)`` sets).
    """
    formula._get_raw = True  # type: ignore[attr-defined]
    return formula


class _GlobalOnly:
    """Stands in for ``FlopCounterMode``'s module tracker: every FLOP counted under ``Global``, no hooks."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *args: object) -> None:
        return None


def without_module_tracking(mode: Any) -> Any:
    """``mode`` (a ``FlopCounterMode``) counting the total only, without tracking which module runs.

    Reach: its ``mod_tracker`` attribute (``torch.utils.flop_counter``), read for ``parents`` and entered with the
    mode. torch's ``ModuleTracker`` puts multi-grad hooks on every module's inputs, and a pipeline stage's
    ``autograd.grad`` over its received (leaf) inputs rejects those ("A leaf node was passed to
    _will_engine_execute_node"). The total, all we read, does not depend on the tracker.
    """
    _require(mode, "mod_tracker", "counting FLOPs without tracking modules")
    mode.mod_tracker = _GlobalOnly()
    return mode


def undecomposed_flop_formulas() -> dict[Any, Callable[..., int]]:
    """Zero-FLOP formulas that make ``FlopCounterMode`` run each op as it runs uncounted (``custom_mapping``).

    Reach: ``torch.utils.flop_counter._FlopCounterMode.__torch_dispatch__``, which runs an op it sees through the
    op's CompositeImplicitAutograd decomposition (``OpOverload.decompose``) unless the op, the overload itself, is a
    key of the counter's registry (torch keys its own formulas by packet, so none is). An op with a kernel of its
    own and such a decomposition is then computed otherwise while counted: ``silu_backward`` (Llama's SiLU MLP)
    rounds otherwise, so a counted step's gradients differed in the last bit from an uncounted one (issue 58).
    Every such aten op (a kernel for CPU or CUDA, and a decomposition) is a key here, overload and packet: it runs
    its own kernel. Each counts zero, as its decomposition does (elementwise work, norms, upsampling).
    """
    import torch

    def nothing(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return 0

    what = "counting FLOPs without decomposing"
    decomposed = _require(torch._C.DispatchKey, "CompositeImplicitAutograd", what)
    own = [getattr(torch._C.DispatchKey, key) for key in ("CPU", "CUDA") if hasattr(torch._C.DispatchKey, key)]
    from torch.utils.flop_counter import flop_registry

    # Ops with a C++ decomposition (``torch.ops.aten`` lists only the ops loaded so far), and the loaded ones:
    # a Python decomposition (``py_impl``) is registered on a loaded op.
    has_kernel = _require(torch._C, "_dispatch_has_kernel_for_dispatch_key", what)
    names = {
        full.split("::", 1)[1].split(".", 1)[0]
        for full in _require(torch._C, "_dispatch_get_all_op_names", what)()
        if full.startswith("aten::") and has_kernel(full, "CompositeImplicitAutograd")
    }
    formulas: dict[Any, Callable[..., int]] = {}
    for name in sorted(names | set(dir(torch.ops.aten))):
        try:
            packet = getattr(torch.ops.aten, name)
            overloads = [getattr(packet, overload) for overload in packet.overloads()]
        except (AttributeError, RuntimeError):  # a name listed but no op in this build
            continue
        for op in overloads:
            try:
                whole = op.has_kernel_for_dispatch_key(decomposed) and any(map(op.has_kernel_for_dispatch_key, own))
            except RuntimeError:  # an overload listed but not registered in this build
                continue
            if whole:
                formulas[op] = raw_flop_formula(nothing)
                if packet not in flop_registry:
                    formulas[packet] = raw_flop_formula(nothing)
    return formulas


def record_memory_history(max_entries: int) -> None:
    """Record CUDA allocations (with stacks), keeping the newest ``max_entries``; 0 stops recording.

    Reach: ``torch.cuda.memory._record_memory_history`` (the documented way to take memory snapshots).
    """
    import torch

    record = _require(torch.cuda.memory, "_record_memory_history", "recording CUDA memory history")
    record(enabled="all" if max_entries > 0 else None, max_entries=max(max_entries, 1))


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded CUDA memory history to ``path`` (a pickle for pytorch.org/memory_viz).

    Reach: ``torch.cuda.memory._dump_snapshot``.
    """
    import torch

    _require(torch.cuda.memory, "_dump_snapshot", "writing a CUDA memory snapshot")(path)


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's argument actions. Reach: ``ArgumentParser._actions``."""
    return list(_require(parser, "_actions", "listing the known configuration keys"))


def subcommand_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of a jsonargparse parser's subcommands (none without subcommands).

    Reach: jsonargparse's ``_subcommands_action`` and argparse's ``_name_parser_map``.
    """
    action = getattr(parser, "_subcommands_action", None)  # absent: a parser without subcommands
    if action is None:
        return []
    return list(_require(action, "_name_parser_map", "listing the subcommands' keys").values())


@contextlib.contextmanager
def declare_configure_model(module: Any) -> Iterator[None]:
    """Within the block, Lightning sees ``module`` as overriding ``configure_model``.

    Reach: ``ModelParallelStrategy.setup`` refuses a module whose ``configure_model`` is not overridden
    (``is_overridden`` compares the code of the instance's attribute with LightningModule's); our FSDP
    strategy has already sharded the module and runs Lightning's set-up after that. An instance attribute
    that does nothing stands in, and is removed after.
    """
    if module is None or "configure_model" in vars(module):
        yield
        return

    def configure_model() -> None:  # the module was sharded by the strategy before Lightning's set-up
        return None

    module.configure_model = configure_model
    try:
        yield
    finally:
        del module.configure_model


def callback_state_key(callback: Any, **fields: Any) -> str:
    """The key a callback's state is stored under, in Lightning's own format, from the fields telling two apart.

    Reach: ``Callback._generate_state_key`` (Lightning 2.x). Lightning's format keeps checkpoints written by
    earlier versions of ours loadable.
    """
    generate: Callable[..., str] = _require(callback, "_generate_state_key", "the callback's state key")
    return generate(**fields)


def cli_subcommand_parser(cli: Any, subcommand: str | None) -> Any:
    """The parser of the running subcommand, which writes the resolved config. Reach: ``LightningCLI._parser``."""
    return _require(cli, "_parser", "writing the resolved config")(subcommand)


def norm_layer_base() -> type:
    """The base class of every BatchNorm and InstanceNorm layer, whose running statistics are per rank.

    Reach: ``torch.nn.modules.batchnorm._NormBase``.
    """
    from torch.nn.modules import batchnorm

    base: type = _require(batchnorm, "_NormBase", "finding per-rank running statistics")
    return base


def strategy_timeout(strategy: Any) -> Any:
    """The collective timeout a Lightning strategy was given (a ``timedelta`` or None). Reach: ``Strategy._timeout``."""
    return _require(strategy, "_timeout", "the checkpoint group's timeout")


def setup_distributed(strategy: Any) -> None:
    """Create the default process group as ``ModelParallelStrategy`` does, minus its device-mesh set-up.

    Reach: ``ModelParallelStrategy._setup_distributed`` (Lightning 2.x); our FSDP builds its own mesh after it.
    """
    _require(strategy, "_setup_distributed", "setting up the process group on CPU")()


def set_num_threads_for_processes(num_processes: int) -> None:
    """Give this rank the CPU thread count Lightning's launchers give theirs: ``cpus // processes per node``.

    A no-op where ``OMP_NUM_THREADS`` is set (torchrun sets it to 1). Reach:
    ``lightning.fabric.utilities.distributed._set_num_threads_if_needed`` (Lightning 2.x), which only a
    strategy's launcher calls, and ``ModelParallelStrategy`` gives a rank that was started for it none.
    """
    from lightning.fabric.utilities import distributed

    _require(distributed, "_set_num_threads_if_needed", "setting each rank's CPU thread count")(num_processes)


def init_deepspeed_distributed(strategy: Any) -> None:
    """Create the default process group as ``DeepSpeedStrategy`` does, without its CUDA device-index checks.

    Reach: ``DeepSpeedStrategy._init_deepspeed_distributed`` (Lightning 2.x).
    """
    _require(strategy, "_init_deepspeed_distributed", "setting up the process group on CPU")()


def set_device_mesh(strategy: Any, mesh: Any) -> None:
    """Give ``strategy`` and its LightningModule the device mesh (what ``module.device_mesh`` returns).

    Reach: ``ModelParallelStrategy._device_mesh`` and ``LightningModule._device_mesh`` (Lightning 2.x), set as
    ``ModelParallelStrategy.setup_environment`` does; ours builds a (shard,) or (replicate, shard) mesh instead.
    """
    module = strategy.lightning_module
    for owner in (strategy, module):
        _require(owner, "_device_mesh", "giving the model its device mesh")
        owner._device_mesh = mesh


def read_dcp_whole(path: Any) -> dict[str, Any]:
    """A DCP folder's whole state dict in memory, as ``dcp_to_torch_save`` reads it, without its temporary file.

    Reach: ``torch.distributed.checkpoint.format_utils._EmptyStateDictLoadPlanner`` and
    ``state_dict_loader._load_state_dict`` (torch 2.2+), what ``dcp_to_torch_save`` does before it writes.
    """
    from torch.distributed.checkpoint import FileSystemReader, format_utils, state_dict_loader

    what = "reading a DCP checkpoint whole"
    planner = _require(format_utils, "_EmptyStateDictLoadPlanner", what)()
    state: dict[str, Any] = {}
    _require(state_dict_loader, "_load_state_dict", what)(
        state, storage_reader=FileSystemReader(path), planner=planner, no_dist=True
    )
    return state


def zero_optimizer_parts(engine: Any) -> tuple[list[list[Any]], list[Any], Any]:
    """A ZeRO engine's parameter groups (the user's order), the fp32 flat partitions, and the optimizer stepping them.

    Reach: ``DeepSpeedZeroOptimizer.bit16_groups``/``single_partition_of_fp32_groups`` (stages 1, 2) and
    ``DeepSpeedZeroOptimizer_Stage3.fp16_groups``/``fp32_partitioned_groups_flat`` (stage 3), DeepSpeed 0.10+.
    """
    what = "loading a full checkpoint into ZeRO"
    optimizer = _require(engine, "optimizer", what)
    if int(engine.zero_optimization_stage()) == 3:
        groups, flats = (
            _require(optimizer, "fp16_groups", what),
            _require(optimizer, "fp32_partitioned_groups_flat", what),
        )
    else:
        groups = _require(optimizer, "bit16_groups", what)
        flats = _require(optimizer, "single_partition_of_fp32_groups", what)
    return [list(group) for group in groups], list(flats), _require(optimizer, "optimizer", what)


def link_zero_optimizer_state(engine: Any) -> None:
    """After the base optimizer's state was created by hand: let ZeRO-1/2's per-parameter views point into it.

    Reach: ``DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state`` and its ``_hp_optimizer_states_linked``
    flag (ZeRO-3 reads the state directly).
    """
    optimizer = engine.optimizer
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def restore_zero_state(strategy: Any, checkpoint: Any, strict: bool) -> None:
    """Load a full state dict into a ZeRO-3 model, gathering and re-sharding each partition.

    Reach: ``DeepSpeedStrategy._restore_zero_state`` (Lightning 2.x).
    """
    _require(strategy, "_restore_zero_state", "loading full weights into ZeRO-3")(checkpoint, strict=strict)


def zero3_step_starts_at_the_outermost_forward(engine: Any) -> bool:
    """Make ZeRO-3 begin a new step at the engine's forward only, not at every call of the root module.

    DeepSpeed resets its parameter-fetch trace in a forward pre-hook on the root module, meaning "a new
    forward pass". Lightning runs ``training_step`` through that root module (its forward redirected), and a
    LightningModule that calls ``self(x)`` inside ``training_step`` (most do) calls the root again: a second
    reset mid-step, so the trace never completes. Every step then re-records (no prefetch; 36 more collectives
    per step on the GPT demo: 92 instead of the hand-written loop's 56). Here the reset runs only when no
    call of the root is already in progress. True if the engine had the hook (ZeRO-3), False otherwise.

    Reach: ``engine.optimizer.parameter_offload`` (training) or the engine's ``DeepSpeedZeRoOffload`` optimizer
    (inference), its ``fwd_pre_hook`` handle and ``get_param_coordinator().reset_step`` (DeepSpeed 0.1x).
    """
    optimizer = getattr(engine, "optimizer", None)
    offload: Any = getattr(optimizer, "parameter_offload", optimizer)
    handle = getattr(offload, "fwd_pre_hook", None)
    if handle is None:
        return False
    coordinator = _require(offload, "get_param_coordinator", "ZeRO-3's step reset")
    root = _require(offload, "module", "ZeRO-3's root module")
    handle.remove()
    depth = [0]

    def start_of_step(module: Any, *args: Any) -> None:
        if depth[0] == 0:
            coordinator().reset_step()
        depth[0] += 1

    def end_of_call(module: Any, *args: Any) -> None:
        depth[0] -= 1

    offload.fwd_pre_hook = _BothHandles(
        root.register_forward_pre_hook(start_of_step, prepend=True),  # before DeepSpeed's own fetch hooks
        root.register_forward_hook(end_of_call, always_call=True),  # a forward that raised ends its call too
    )
    return True


class _BothHandles:
    """Two hook handles that DeepSpeed's ``fwd_pre_hook.remove()`` removes together."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def deepspeed_micro_batch_size(strategy: Any) -> int:
    """The micro-batch size Lightning's DeepSpeed strategy reads from the train loader.

    Reach: ``DeepSpeedStrategy._auto_select_batch_size`` (Lightning 2.x).
    """
    size: int = _require(strategy, "_auto_select_batch_size", "DeepSpeed's micro-batch size")()
    return size


def wandb_init_kwargs(logger: Any) -> dict[str, Any]:
    """The arguments Lightning's ``WandbLogger`` will pass to ``wandb.init`` (mutable). Reach: ``_wandb_init``."""
    kwargs: dict[str, Any] = _require(logger, "_wandb_init", "the W&B run's arguments")
    return kwargs


def wandb_run_if_started(logger: Any) -> Any | None:
    """The W&B run of a ``WandbLogger``, or None before it started one. Reach: ``WandbLogger._experiment``."""
    return _require(logger, "_experiment", "the W&B run")


def wandb_requested_id(logger: Any) -> str | None:
    """The run id a ``WandbLogger`` was given (``id=`` or ``version=``), or None. Reach: ``WandbLogger._id``."""
    return _require(logger, "_id", "the W&B run id")


def route_torchrun_signals(on_signal: Callable[[int], bool]) -> None:
    """Have torchrun's agent ask ``on_signal(signum)`` first; only when it returns True does torchrun act.

    torchrun installs its handler when it starts the workers, replacing any earlier one; ``launch`` must still
    know which signal came (to say so, and to quiet torchrun's shutdown log), and a second signal must not
    interrupt torchrun's wait for its workers (it would start the wait again). Reach: the module-level
    ``_terminate_process_handler`` of ``torch.distributed.elastic.multiprocessing.api``, looked up by name when
    the handlers are installed.
    """
    from torch.distributed.elastic.multiprocessing import api

    theirs = _require(api, "_terminate_process_handler", "torchrun's signal handler")
    theirs = getattr(theirs, "torchrun_handler", theirs)  # routed before: wrap torchrun's own once

    def handler(signum: int, frame: FrameType | None) -> None:
        if on_signal(signum):
            theirs(signum, frame)

    handler.torchrun_handler = theirs  # type: ignore[attr-defined]
    api._terminate_process_handler = handler


def signal_workers_not_their_children() -> None:
    """Torchrun passes a signal to each worker alone, not to the worker's whole process group.

    torchrun ``killpg``s each worker's session, DataLoader workers included; a DataLoader worker killed by a
    SIGTERM from anyone but its parent (or by a SIGUSR1, whose default action is to end the process) makes its
    rank raise "DataLoader worker exited unexpectedly" at an arbitrary point, instead of saving at the next
    step boundary. The rank's own exit ends its DataLoader workers. SIGKILL (after the grace) still goes to the
    group. Reach: ``SubprocessHandler.close`` and its ``_stdout``/``_stderr`` files.
    """
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    cls = _require(subprocess_handler, "SubprocessHandler", "torchrun's worker handle")
    theirs = getattr(cls.close, "torchrun_close", cls.close)

    def close(self: Any, death_sig: signal.Signals | None = None) -> None:
        if death_sig is None or death_sig == signal.SIGKILL:
            theirs(self, death_sig)
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(death_sig)
        for name in ("_stdout", "_stderr"):
            handle = _require(self, name, "torchrun's worker output files")
            if handle:
                handle.close()

    close.torchrun_close = theirs  # type: ignore[attr-defined]
    cls.close = close


# Private methods of Lightning that our subclasses override, extending them where no public hook exists. An
# upgrade that renames one would silently stop calling ours; tests/test_compat.py checks that each still
# exists on its base class and that no other private override exists.
PRIVATE_OVERRIDES = {
    # MLOptCLI: adds its default callbacks (startup, progress bar) to the ones the config names.
    ("lightning.pytorch.cli", "LightningCLI", "_instantiate_trainer"),
    # ParseOnlyCLI (``check_arguments``): parses and validates only, so it does not seed.
    ("lightning.pytorch.cli", "LightningCLI", "_set_seed"),
    # MLOptCLI: checks ``ckpt_path`` before Lightning reads a file's hyperparameters from it (torch.load).
    ("lightning.pytorch.cli", "LightningCLI", "_parse_ckpt_path"),
    # DDPStrategy: none (comm hooks go through the public configure_ddp).
    # DeepSpeedStrategy: engine set-up on CPU, inference set-up on CPU, the preset-built config.
    ("lightning.pytorch.strategies.deepspeed", "DeepSpeedStrategy", "_setup_model_and_optimizer"),
    ("lightning.pytorch.strategies.deepspeed", "DeepSpeedStrategy", "_initialize_deepspeed_inference"),
    ("lightning.pytorch.strategies.deepspeed", "DeepSpeedStrategy", "_format_config"),
}
