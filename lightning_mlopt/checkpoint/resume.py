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

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import Sampler

from lightning_mlopt._compat import epoch_loaders, preload_checkpoint, resume_start
from lightning_mlopt.checkpoint.data_order import (
    data_seed,
    exactness_notes,
    resumable_loaders,
    samples_in_epoch,
    seed_epoch,
    seed_evaluation,
)
from lightning_mlopt.checkpoint.layout import CheckpointLayout, can_resume, layout_of_manifest
from lightning_mlopt.checkpoint.manifest import Manifest
from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
from lightning_mlopt.checkpoint.rng import restore_rng_state
from lightning_mlopt.checkpoint.serialization import allowlisted_loading, load_file
from lightning_mlopt.checkpoint.store import STATE_NAME, CheckpointStore
from lightning_mlopt.checkpoint.trust import check_trusted
from lightning_mlopt.exceptions import ObjectStoreError, UntrustedCheckpointError

RNG_DIR = "rng"  # rng/rank-<r>.pt in every checkpoint folder


@dataclass(frozen=True)
class ResumeChoice:
    """What rank zero chose: a checkpoint and whether it stays finished, or why not (then ``path`` is None).

    ``refusal``: bad input (the checkpoint does not fit this run); ``failure``: the remote tier could not be read.
    """

    path: Path | None
    stays_final: bool = False
    refusal: str | None = None
    manifest: Manifest | None = None
    failure: str | None = None


@dataclass(frozen=True)
class ResumingStrategy:
    """The run's strategy as resume judges a checkpoint against it.

    Args:
        name: its class name (what manifests record).
        layout: the layout it writes (what it can resume from).
        known: every layout the package knows (a manifest older than the recorded layout names its strategy).

    """

    name: str
    layout: CheckpointLayout
    known: tuple[CheckpointLayout, ...] = ()


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
    refusal = strategy_switch_refusal(entry.manifest, strategy, entry.path)
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
            "To train on (e.g. with a larger max_steps), set checkpoint.resume.final: true."
        )
        return ResumeChoice(entry.path, stays_final=True, manifest=entry.manifest)
    how = "a finished run, resume.final is set" if entry.manifest.final else f"saved by {entry.manifest.reason}"
    rank_zero_info(f"Auto-resuming from {entry.path} (step {entry.step}, {how}).")
    return ResumeChoice(entry.path, manifest=entry.manifest)


def strategy_switch_refusal(saved: Manifest, strategy: ResumingStrategy, path: Path) -> str | None:
    """A one-line refusal when the checkpoint's layout cannot be resumed by this run's strategy, else None."""
    saved_layout = layout_of_manifest(saved.layout, saved.strategy, strategy.known)
    if can_resume(saved_layout, strategy.layout):
        return None
    current, current_layout = strategy.name, strategy.layout.name
    return (
        f"cannot resume {path} (written by {saved.strategy}: {saved_layout}) with {current} ({current_layout}). "
        "Resuming works with the same strategy family at any world size (DDP, FSDP; ZeRO at the same world size), "
        "and from DDP to FSDP. Go back to the strategy that wrote it, or start a new run (another run_dir); "
        "`python -m lightning_mlopt checkpoint consolidate` turns any checkpoint into one Lightning file of weights."
    )


def preload(trainer: Any, folder: Path, trust_pickles: bool) -> str:
    """Load ``folder``'s state into Lightning's checkpoint connector, so the restore Lightning does next uses it.

    Lightning takes a checkpoint path only as a ``fit`` argument; an explicit ``ckpt_path`` loads later and
    wins. Returns the path Lightning will report as its ``ckpt_path``.
    """
    state = folder / STATE_NAME
    if state.is_file():
        # One file: memory-mapped (verification just read it, so its pages are cached: no second copy;
        # ranks on one machine share them), under the allowlist.
        preload_checkpoint(trainer, state, load_file(state, trust_pickles, mmap=True))
    else:
        # Every pickle in it was checked against the allowlist when it was chosen; torch's own loader checks
        # again where Lightning calls it (DCP's meta.pt).
        with allowlisted_loading():
            resume_start(trainer, state, weights_only=not trust_pickles)
    return str(state)


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


def position_in_epoch(trainer: Any, rng_state: dict[str, Any] | None, resumed: bool) -> dict[str, Any] | None:
    """At train start: this epoch's data in the order (seed, epoch) gives; resumed, the position and the RNGs too.

    Lightning created this epoch's iterator before this hook, drawing its order from the global RNG
    (``checkpoint/data_order.py``): it is created again, from (seed, epoch). Resumed mid-epoch, the batches the
    epoch used are skipped at the sampler, and the RNG states to restore right before the next step are
    returned; resumed at an epoch's end, the RNGs are restored now. Reads Lightning's loop progress and its data
    fetcher and combined loader (the loop's own record of the position).
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
    if 0 < done < trainer.num_training_batches:
        skip_first_batches(loaders, done)
        samples = samples_in_epoch(done, loaders, trainer.world_size)
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


DATA_POSITION_KEY = "data_position"  # in every checkpoint's state: see data_position()


def data_position(trainer: Any) -> dict[str, Any]:
    """Where the training data stands, world-size free: epoch, order seed and samples the job consumed in it.

    ``samples`` is None where a loader's batch size is unknown.

    Example::

        {"epoch": 1, "seed": 1234, "batches_per_rank": 8, "samples": 512}
    """
    _, combined = epoch_loaders(trainer)
    batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    loaders = combined.flattened if combined is not None else []
    return {
        "epoch": trainer.current_epoch,
        "seed": data_seed(),
        "batches_per_rank": batches,
        "samples": samples_in_epoch(batches, loaders, trainer.world_size),
    }


def order_this_epoch(trainer: Any) -> None:
    """At an epoch's start, before Lightning creates its iterator: its order from (seed, epoch)."""
    _, combined = epoch_loaders(trainer)
    seed_epoch(combined.flattened if combined is not None else [], data_seed(), trainer.current_epoch)


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


class _SkipOnce(Sampler[list[int]]):
    """A batch sampler that drops its first ``skip`` batches once, then passes everything through."""

    def __init__(self, batch_sampler: Iterable[list[int]], skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        iterator = iter(self.batch_sampler)
        skip, self.skip = self.skip, 0
        for _ in range(skip):  # indices only: no sample is loaded
            next(iterator, None)
        yield from iterator

    def __len__(self) -> int:
        # The full length: Lightning counts batches from the restored position itself.
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # batch_size, drop_last, sampler... are read through by DataLoader and Lightning.
        return getattr(self.batch_sampler, name)


def skip_first_batches(loaders: Iterable[Any], count: int) -> None:
    """Make each map-style DataLoader's next iteration start at batch ``count``.

    Loaders that cannot skip at a sampler (an iterable-style dataset, not a DataLoader) or restore their own
    position (a ``state_dict``: Lightning loads it) are left as they are; ``exactness_notes`` names the former.
    """
    for loader in resumable_loaders(loaders):
        # DataLoader forbids reassigning batch_sampler after construction; this is the one sanctioned use.
        assert loader.batch_sampler is not None  # map-style: DataLoader always has one
        object.__setattr__(loader, "batch_sampler", _SkipOnce(loader.batch_sampler, count))
