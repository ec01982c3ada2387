"""Resuming: which checkpoint (verified, trusted, fitting the strategy), loading it, and the exact position.

The position: each epoch's data order is a function of (seed, epoch) (``data_order.py``); a mid-epoch resume
skips the batches the epoch already used, at the sampler, without loading them, and puts every RNG back where
the uninterrupted run had it for the next step.

Example::

    choice = choose_checkpoint(store, ResumingStrategy("DDPStrategy", LAYOUTS["one file"]), False, False)  # rank 0
    preload(trainer, choice.path, trust_pickles=False)
    pending_rng = position_in_epoch(trainer, load_rng(choice.path, rank, world_size), resumed=True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mlopt._compat import epoch_loaders, loaded_checkpoint, preload_checkpoint, resume_start
from lightning_mlopt.checkpoint.conversion import converted_copy
from lightning_mlopt.checkpoint.data_order import (
    data_seed,
    exactness_notes,
    resumable_loaders,
    samples_in_epoch,
    seed_epoch,
    seed_evaluation,
)
from lightning_mlopt.checkpoint.data_position import (
    SkipFirstOnce,
    data_replicas,
    samples_to_skip,
    saved_replicas,
    set_batches_done,
    skip_first_samples,
)
from lightning_mlopt.checkpoint.layout import (
    ONE_FILE,
    CheckpointLayout,
    can_resume,
    layout_of_manifest,
)
from lightning_mlopt.checkpoint.manifest import Manifest
from lightning_mlopt.checkpoint.optimizer_keys import group_names, keyed_by_index
from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
from lightning_mlopt.checkpoint.rng import restore_rng_state
from lightning_mlopt.checkpoint.serialization import allowlisted_loading, load_file
from lightning_mlopt.checkpoint.settings import CHECKPOINT
from lightning_mlopt.checkpoint.store import STATE_NAME, CheckpointStore
from lightning_mlopt.checkpoint.trust import check_trusted
from lightning_mlopt.exceptions import (
    BadInputError,
    CheckpointWriteError,
    ObjectStoreError,
    UntrustedCheckpointError,
    first_line,
    said_by_rank_zero,
)

RNG_DIR = "rng"  # rng/rank-<r>.pt in every checkpoint folder


@dataclass(frozen=True)
class ResumeChoice:
    """What rank zero chose: a checkpoint and whether it stays finished, or why not (then ``path`` is None).

    ``refusal``: bad input (the checkpoint does not fit this run); ``failure``: the remote tier could not be read.
    ``convert_from``: the layout ``path`` is in when the strategy loads it only once converted
    (:func:`converted_for`, on every rank, after the choice is shared).
    """

    path: Path | None
    stays_final: bool = False
    refusal: str | None = None
    manifest: Manifest | None = None
    failure: str | None = None
    convert_from: str | None = None


@dataclass(frozen=True)
class ResumingStrategy:
    """The run's strategy as resume judges a checkpoint against it.

    Args:
        name: its class name (what manifests record).
        layout: the layout it writes (what it can resume from).
        known: every layout the package knows (a manifest older than the recorded layout names its strategy).
        loads_own: for a checkpoint of its own layout, whether the strategy loads it as it is, called as
            ``loads_own(state_path, saved_world_size)`` (DeepSpeed: only at the world size and with the stage
            family that wrote it); None: always.

    """

    name: str
    layout: CheckpointLayout
    known: tuple[CheckpointLayout, ...] = ()
    loads_own: Callable[[Path, int], bool] | None = None


def choose_checkpoint(
    store: CheckpointStore,
    strategy: ResumingStrategy,
    trust_pickles: bool,
    resume_final: bool,
    remote: RemoteCheckpoints | None = None,
    remote_required: bool = True,
) -> ResumeChoice | None:
    """Rank zero: clean interrupted saves, take the newest checkpoint that verifies, check it fits and is trusted.

    ``strategy``: the run's strategy, its layout and the layouts known. ``remote``: a remote tier whose
    newer checkpoints are downloaded (verified) into ``store`` first; ``remote_required``: a remote that cannot
    be read fails the resume (else the local tier is used, with a warning). None when there is nothing to
    resume from.
    """
    for restored in store.restore_replaced():
        rank_zero_info(f"Put back {restored}: a save of the same step was interrupted while replacing it")
    for leftover in store.clean_staging():
        rank_zero_info(f"Removed an interrupted save: {leftover}")
    skipped: list[Any] = []
    entry = store.newest_valid(skipped)
    if remote is not None:
        try:
            entry = (
                remote.download_newest_valid(store, newer_than=entry.step if entry else -1, skipped=skipped) or entry
            )
        except ObjectStoreError as error:
            if remote_required:
                return ResumeChoice(None, failure=f"cannot resume from the remote tier: {error}")
            rank_zero_warn(f"The remote tier could not be read ({error}); resuming from the local tier.")
    for bad in skipped:
        rank_zero_warn(f"Checkpoint {bad.path} failed verification ({bad.problem}); trying an older one.")
    if entry is None:
        return None
    assert entry.manifest is not None
    readable = conversion_source(entry.manifest, strategy, entry.path)
    refusal = None if readable is not None else strategy_switch_refusal(entry.manifest, strategy, entry.path)
    if refusal is None:
        try:
            check_trusted(entry.path, trust_pickles)  # before anything in it is unpickled
        except UntrustedCheckpointError as error:
            refusal = str(error)
    if refusal is not None:
        return ResumeChoice(None, refusal=refusal, manifest=entry.manifest)
    if entry.manifest.final and not resume_final:
        rank_zero_info(
            f"{entry.path} is marked final: this run already finished at step {entry.step}; not training again. "
            f"To train on (e.g. with a larger max_steps), set {CHECKPOINT.setting('resume.final', True)}."
        )
        return ResumeChoice(entry.path, stays_final=True, manifest=entry.manifest)
    final_set = f"a finished run, {CHECKPOINT.setting('resume.final', True)}"
    how = final_set if entry.manifest.final else f"saved by {entry.manifest.reason}"
    rank_zero_info(f"Auto-resuming from {entry.path} (step {entry.step}, {how}).")
    convert_from = readable.name if readable is not None else None
    return ResumeChoice(entry.path, manifest=entry.manifest, convert_from=convert_from)


def loads_as_it_is(saved: Manifest, strategy: ResumingStrategy, path: Path) -> bool:
    """Whether the strategy loads the checkpoint at ``path`` without conversion."""
    saved_layout = layout_of_manifest(saved.layout, saved.strategy, strategy.known)
    if saved_layout == strategy.layout.name and strategy.loads_own is not None:
        return strategy.loads_own(path / STATE_NAME, saved.world_size)
    return can_resume(saved_layout, strategy.layout)


def conversion_source(saved: Manifest, strategy: ResumingStrategy, path: Path) -> CheckpointLayout | None:
    """The layout of a checkpoint this strategy cannot load as it is but can once converted to one file; else None."""
    if loads_as_it_is(saved, strategy, path) or not can_resume(ONE_FILE, strategy.layout):
        return None
    saved_layout = layout_of_manifest(saved.layout, saved.strategy, strategy.known)
    return next((each for each in strategy.known if each.name == saved_layout and each.consolidate), None)


def converted_for(
    choice: ResumeChoice, strategy: ResumingStrategy, root: Path, trust_pickles: bool, rank: int = 0
) -> Path:
    """Every rank: the chosen checkpoint's one-file copy under ``root/converted`` (rank zero converts it).

    Raises:
        BadInputError: it cannot be converted (one line; said by the process that tried).
        CheckpointWriteError: the copy could not be written (a full disk).

    """
    assert choice.path is not None and choice.convert_from is not None
    layout = next(each for each in strategy.known if each.name == choice.convert_from)
    try:
        path, described = converted_copy(choice.path, root, layout, trust_pickles, may_convert=rank == 0)
    except BadInputError:
        raise
    except OSError as error:  # a disk that cannot take the copy: a write failure, not bad input
        raise CheckpointWriteError(f"converting {choice.path} failed: {error}") from None
    except Exception as error:  # whatever the reader raised: one line
        refusal = f"cannot convert {choice.path} ({layout.name}) for {strategy.name}: {first_line(error)}"
        raise BadInputError(refusal) from None
    how = f"converted: {described}" if described else "converted before"
    rank_zero_info(f"{choice.path} is in {layout.name}; resuming from its one-file copy {path} ({how}).")
    return path


def strategy_switch_refusal(saved: Manifest, strategy: ResumingStrategy, path: Path) -> str | None:
    """A one-line refusal when the checkpoint can be neither loaded by this run's strategy nor converted, else None."""
    if loads_as_it_is(saved, strategy, path) or conversion_source(saved, strategy, path) is not None:
        return None
    saved_layout = layout_of_manifest(saved.layout, saved.strategy, strategy.known)
    return (
        f"cannot resume {path} (written by {saved.strategy} on {saved.world_size} processes: {saved_layout}) with "
        f"{strategy.name} ({strategy.layout.name}). Our "
        "strategies resume any checkpoint of ours at any world size, converting it where needed; this strategy "
        "or layout is not one of them. Go back to the strategy that wrote it, or start a new run (another "
        "run_dir); `python -m lightning_mlopt checkpoint consolidate` turns any checkpoint into one Lightning file "
        "of weights."
    )


def preload(trainer: Any, folder: Path, trust_pickles: bool) -> str:
    """Load ``folder``'s state into Lightning's checkpoint connector, so the restore Lightning does next uses it.

    Lightning takes a checkpoint path only as a ``fit`` argument; an explicit ``ckpt_path`` loads later and
    wins. Returns the path Lightning will report as its ``ckpt_path``.
    """
    state = folder / STATE_NAME
    if state.is_file() and not trainer.strategy.restore_checkpoint_after_setup:
        # One file: memory-mapped (verification just read it, so its pages are cached: no second copy;
        # ranks on one machine share them), under the allowlist.
        preload_checkpoint(trainer, state, load_file(state, trust_pickles, mmap=True))
    else:
        # Sharded strategies load through their own reader (a full file too: they shard it as they load it).
        # Every pickle in it was checked against the allowlist when it was chosen; torch's own loader checks
        # again where Lightning calls it (DCP's meta.pt).
        with allowlisted_loading():
            resume_start(trainer, state, weights_only=not trust_pickles)
    return str(state)


def refuse_misfit(trainer: Any, folder: Path) -> None:
    """Every rank, after :func:`preload` of one file: a checkpoint whose weights do not fit the model, refused.

    Lightning would fail later, in its restore, with a traceback of every mismatched tensor. The usual cause is
    a relaunch into a run with other model settings (an explicit ``run_dir``, a changed width).

    Raises:
        BadInputError: naming the first mismatches and the fix (said by rank zero; every rank read the same file).

    """
    module = trainer.lightning_module
    saved = (loaded_checkpoint(trainer) or {}).get("state_dict")
    current = module.state_dict() if module is not None and getattr(module, "strict_loading", True) else {}
    if not saved or not current or any(tensor.is_meta for tensor in current.values()):  # not built yet: no check
        return
    # Shapes of the names both hold, only: at setup a model may not have built every module yet (configure_model,
    # its own setup), and its on_load_checkpoint may still rename keys; Lightning's strict load judges those.
    problems = [
        f"{key}: saved {list(saved[key].shape)}, model {list(tensor.shape)}"
        for key, tensor in current.items()
        if key in saved and hasattr(saved[key], "shape") and saved[key].shape != tensor.shape
    ]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        with said_by_rank_zero(trainer.global_rank):
            raise BadInputError(
                f"{folder} does not fit this model: {'; '.join(problems[:3])}{more}. It was saved with other model "
                "settings: relaunch with the ones it was saved with (the run's config.yaml), or give this model a "
                "run_dir of its own"
            )


def number_optimizer_states(trainer: Any) -> None:
    """Before Lightning restores the optimizers: a named optimizer state (a conversion's) numbered for them.

    ``optimizer.load_state_dict`` takes parameters by number; a checkpoint converted from a sharded layout
    names them. Strategies that load optimizers themselves (FSDP, DeepSpeed) have already done so.
    """
    checkpoint = loaded_checkpoint(trainer)
    states = (checkpoint or {}).get("optimizer_states")
    if not states or trainer.strategy.restore_checkpoint_after_setup:
        return
    module = trainer.lightning_module
    with said_by_rank_zero(trainer.global_rank):  # every rank reads the same file: one says why it does not fit
        checkpoint["optimizer_states"] = [  # type: ignore[index]
            keyed_by_index(state, group_names(optimizer, module))
            for state, optimizer in zip(states, trainer.optimizers, strict=False)
        ]


def load_rng(folder: Path, rank: int, world_size: int, trust_pickles: bool) -> dict[str, Any] | None:
    """The saved RNG states of ``rank``; None (with a warning) when the world size changed."""
    path = folder / RNG_DIR / f"rank-{rank}.pt"
    saved_world = len(list((folder / RNG_DIR).glob("rank-*.pt")))
    if saved_world != world_size or not path.is_file():
        rank_zero_warn(
            f"Resuming at world size {world_size} from a checkpoint written by {saved_world} processes: "
            "RNG states are not restored, so the run continues correctly but not bitwise identically."
        )
        return None
    # Verified with the rest of the checkpoint (manifest checksums, allowlist) before this unpickling.
    return load_file(path, trust_pickles=trust_pickles)


def position_in_epoch(
    trainer: Any, rng_state: dict[str, Any] | None, resumed: bool, saved: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """At train start: this epoch's data in the order (seed, epoch) gives; resumed, the position and the RNGs too.

    Lightning created this epoch's iterator before this hook, drawing its order from the global RNG
    (``checkpoint/data_order.py``): it is created again, from (seed, epoch). Resumed mid-epoch, the batches the
    epoch used are skipped at the sampler, and the RNG states to restore right before the next step are
    returned; resumed at an epoch's end, the RNGs are restored now. Reads Lightning's loop progress and its data
    fetcher and combined loader (the loop's own record of the position). ``saved``: the checkpoint's data
    position; written at another world size, each rank starts where its share of the rest of the epoch begins
    (``data_position.py``).
    """
    fetcher, combined = epoch_loaders(trainer)
    loaders = combined.flattened if combined is not None else []
    say_what_is_not_exact(loaders, "Resuming" if resumed else "Exact resume")
    for line in seed_epoch(loaders, data_seed(), trainer.current_epoch):
        rank_zero_info(f"Exact resume: {line}.")
    seed_evaluation(_flat(trainer.val_dataloaders), data_seed())
    # `processed`, not `completed`: a save inside on_train_batch_end precedes that batch's completion,
    # which Lightning itself counts again on restart.
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed if resumed else 0
    pending = None
    if done and saved and saved_replicas(saved, loaders) not in (None, data_replicas(trainer)):
        done = _continue_at_another_size(trainer, loaders, saved)
    elif 0 < done < trainer.num_training_batches:
        skip_first_batches(loaders, done)
        samples = samples_in_epoch(done, loaders, data_replicas(trainer))
        counted = f" ({samples} samples in all)" if samples is not None else ""
        rank_zero_info(f"Resuming mid-epoch: skipping the {done} batches{counted} epoch {trainer.current_epoch} used")
        # The uninterrupted run's next step drew from the RNGs as they were at the save: restored right before it.
        pending = rng_state
    elif rng_state is not None:
        # Saved at the end of an epoch: the uninterrupted run went on from the saved RNG state.
        restore_rng_state(rng_state)
    if fetcher is not None:
        iter(fetcher)  # a new iterator, in the (seed, epoch) order, starting after any skipped batches
    return pending


def order_this_epoch(trainer: Any) -> None:
    """At an epoch's start, before Lightning creates its iterator: its order from (seed, epoch)."""
    _, combined = epoch_loaders(trainer)
    seed_epoch(combined.flattened if combined is not None else [], data_seed(), trainer.current_epoch)


def _continue_at_another_size(trainer: Any, loaders: list[Any], saved: dict[str, Any]) -> int:
    """Resumed with another number of data replicas mid-epoch: each rank skips its share of the samples used."""
    replicas, before = data_replicas(trainer), saved_replicas(saved, loaders)
    per_rank, why_not = samples_to_skip(saved, loaders, replicas)
    if per_rank is None:
        rank_zero_warn(
            f"Resuming with {replicas} data-parallel processes from {before}: not exact: {why_not}; the epoch's "
            "share of each rank starts again."
        )
        set_batches_done(trainer, 0)
        return 0
    loader = resumable_loaders(loaders)[0]
    # Saved at the epoch's end (nothing left to skip): the epoch is as done at this size as it was at the other.
    # samples_to_skip placed a position, so it knew the loader's batch size.
    batches = per_rank // int(loader.batch_size or 1) if per_rank else int(trainer.num_training_batches)
    set_batches_done(trainer, batches)
    if per_rank:
        skip_first_samples(loader, per_rank)
        rank_zero_info(
            f"Resuming mid-epoch with {replicas} data-parallel processes (saved by {before}): the epoch used "
            f"{saved['samples']} samples; each rank starts after its {per_rank} ({batches} batches of this size)"
        )
    return batches


def say_what_is_not_exact(loaders: Iterable[Any], when: str) -> None:
    """One line per training loader a mid-epoch resume cannot place exactly (rank zero), naming the remedy."""
    for note in exactness_notes(loaders):
        rank_zero_warn(f"{when}: not exact: {note}.")


def _flat(loaders: Any) -> list[Any]:
    """The loaders in Lightning's ``trainer.val_dataloaders`` (one, a list, a dict, or None)."""
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def skip_first_batches(loaders: Iterable[Any], count: int) -> None:
    """Make each map-style DataLoader's next iteration start at batch ``count``.

    Loaders that cannot skip at a sampler (an iterable-style dataset, not a DataLoader) or restore their own
    position (a ``state_dict``: Lightning loads it) are left as they are; ``exactness_notes`` names the former.
    """
    for loader in resumable_loaders(loaders):
        # DataLoader forbids reassigning batch_sampler after construction; this is the one sanctioned use.
        assert loader.batch_sampler is not None  # map-style: DataLoader always has one
        object.__setattr__(loader, "batch_sampler", SkipFirstOnce(loader.batch_sampler, count))
