"""What ``--ckpt_path`` names, made loadable before any Trainer exists: resolved, verified, converted or refused.

``ckpt_path`` may name our step folders, checkpoints folders and run folders (``checkpoint/locate.py``); a
checkpoint the configured strategy cannot load as it is (ZeRO partitions under FSDP, DCP shards under DDP, ZeRO
at another world size) is converted once into this run's ``checkpoints/converted/``; one that no strategy of
ours reads is refused in one line (exit 2), nothing written.

Example::

    described = resolve_ckpt_path(config, run_dir)  # config["ckpt_path"] now names the file Lightning loads
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, Manifest
from lightning_mlopt.checkpoint.remote.tiers import checkpoint_folder
from lightning_mlopt.checkpoint.settings import configured
from lightning_mlopt.process.launcher import is_global_rank_zero


def read_by_lightning(value: Any, read: Callable[[], None]) -> None:
    """Run LightningCLI's own ``ckpt_path`` reading (``read``: the hyperparameters of a file) on a path checked first.

    Lightning reads a file before anything of ours runs: a path that does not exist, or a file that is no
    checkpoint, is refused here in one line (exit 2), before any file of the run is written.

    Raises:
        BadInputError: naming the path and what ``ckpt_path`` takes.

    """
    from lightning_mlopt.checkpoint.locate import refuse_missing
    from lightning_mlopt.exceptions import BadInputError
    from lightning_mlopt.run_dir import RUN_DIR_PLACEHOLDER

    if value and RUN_DIR_PLACEHOLDER not in str(value):  # a placeholder is filled in later: checked then
        refuse_missing(str(value))
    try:
        read()
    except BadInputError:
        raise
    except Exception as error:  # torch.load could not read it; its advice to unpickle anything is not passed on
        raise BadInputError(
            f"ckpt_path: {value} is not a checkpoint torch.load reads with weights_only=True "
            f"({type(error).__name__}); name a checkpoint file, a step folder, a checkpoints folder or a run folder"
        ) from None


def prefer_own_checkpoint(config: Namespace, run_dir: Path) -> str | None:
    """``fit``: the given ``ckpt_path`` is the warm start of a run with no checkpoint of its own.

    With ``checkpoint.resume.auto`` on, a run that has a checkpoint of its own resumes from its newest
    (``checkpoint/warm_start.py``): ``config["ckpt_path"]`` is cleared, before anything of the given path is read
    or converted, and auto-resume takes the run's own. ``checkpoint.resume.ckpt_path: always`` keeps the given
    path. Every rank decides alone from what they all see (the run's checkpoint folder, the object store).

    Returns:
        The line that says which checkpoint the launch starts from and why (rank zero prints it); None when
        there is no ``ckpt_path`` or auto-resume is off (then the given path is simply loaded).

    Raises:
        CheckpointWriteError: the object store of ``checkpoint.dirpath`` could not be listed.

    Example::

        said = prefer_own_checkpoint(config, run_dir)  # before resolve_ckpt_path: a discarded path is not converted

    """
    from lightning_mlopt.checkpoint.warm_start import WarmStart, own_newest

    value, checkpoint = config.get("ckpt_path"), config.get("checkpoint")
    if not value or not checkpoint or not configured(checkpoint, "resume.auto", True):
        return None
    choice = WarmStart(
        str(value), own_newest(checkpoint, run_dir), configured(checkpoint, "resume.ckpt_path", "warm_start")
    )
    if not choice.loads_given:
        config["ckpt_path"] = None
    return choice.line()


def resolve_ckpt_path(config: Namespace, run_dir: Path) -> str | None:
    """``ckpt_path`` may name our step folders, checkpoints folders, run folders, last/best: resolved and verified.

    Sets ``config["ckpt_path"]`` to the file Lightning loads and returns how it was found (None: left as given).
    Every pickle in it (our step folder whole, RNG files included) is checked before Lightning loads it.
    """
    from lightning_mlopt.checkpoint.locate import resolve_checkpoint_path
    from lightning_mlopt.checkpoint.store import STATE_NAME
    from lightning_mlopt.checkpoint.trust import check_trusted
    from lightning_mlopt.exceptions import BadInputError

    value = config.get("ckpt_path")
    if not value:
        return None
    checkpoint = config.get("checkpoint")
    local_tier = configured(checkpoint, "tiers.local_dirpath")
    own = checkpoint_folder(configured(checkpoint, "dirpath"), local_tier, run_dir)
    path, described = resolve_checkpoint_path(str(value), own, mode=configured(checkpoint, "keep.mode", "min"))
    target = Path(path).parent if described is not None and Path(path).name == STATE_NAME else Path(path)
    trust = bool(configured(checkpoint, "resume.trust_pickles"))
    readable = _unreadable_layout(config, target.parent if target.name == STATE_NAME else target)
    if target.exists():
        check_trusted(target, trust)
    if readable is not None and own is not None:
        return _convert_for_this_strategy(config, target, readable, own, trust)
    if described is not None:
        config["ckpt_path"] = path
    elif target.is_dir() and _loads_one_file(config):
        raise BadInputError(
            f"ckpt_path: {value} is a folder with no checkpoint of ours in it (no step-*/ folder, no manifest.json), "
            "and the configured strategy loads one file; name a checkpoint file, a step folder or a run folder"
        )
    return described


def _loads_one_file(config: Namespace) -> bool:
    """Whether the configured strategy loads a checkpoint from one file (not a strategy's folder of shards)."""
    from lightning_mlopt.checkpoint.layout import ONE_FILE

    layout = _configured_layout(config.as_dict().get("trainer") or {})
    return layout is not None and layout.name == ONE_FILE


def _convert_for_this_strategy(config: Namespace, step_folder: Path, layout: Any, into: Path, trust: bool) -> str:
    """``ckpt_path`` in a layout the strategy cannot load: its one-file copy in this run's ``converted/``."""
    from lightning_mlopt.checkpoint.conversion import converted_copy
    from lightning_mlopt.checkpoint.store import STATE_NAME
    from lightning_mlopt.exceptions import BadInputError, first_line

    try:
        # Rank zero converts (and says what it converted); the job's other ranks wait for its copy.
        copy, described = converted_copy(step_folder, into, layout, trust, may_convert=is_global_rank_zero())
    except BadInputError:
        raise
    except Exception as error:  # whatever the reader raised: one line, nothing written
        raise BadInputError(
            f"ckpt_path: {step_folder} ({layout.name}) cannot be converted: {type(error).__name__}: {first_line(error)}"
        ) from None
    config["ckpt_path"] = str(copy / STATE_NAME)
    how = f"converted: {described}" if described else "converted before"
    return f"{step_folder} is in {layout.name}; loading its one-file copy {copy} ({how})"


def _unreadable_layout(config: Namespace, step_folder: Path) -> Any:
    """The layout of ``step_folder`` (one of ours) when the strategy loads it only once converted; else None.

    Raises:
        BadInputError: a layout the strategy cannot load even converted (Lightning would fail deep in its
            restore: DDP opening DCP's folder, ``IsADirectoryError``; DeepSpeed another world size).

    """
    from lightning_mlopt.checkpoint.layout import ONE_FILE, ZERO_PARTITIONS, can_resume, layout_of_manifest
    from lightning_mlopt.checkpoint.store import STATE_NAME
    from lightning_mlopt.exceptions import BadInputError
    from lightning_mlopt.planning.auto import world_size_of
    from lightning_mlopt.strategies import LAYOUTS, layout_named
    from lightning_mlopt.strategies.deepspeed.zero_checkpoint import loads_as_it_is_under_zero

    try:
        manifest = Manifest.from_json((step_folder / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError):
        return None  # not one of our step folders: Lightning reads it as it is
    trainer = config.as_dict().get("trainer") or {}
    current = _configured_layout(trainer)
    if current is None:
        return None
    layout = layout_of_manifest(manifest.layout, manifest.strategy, LAYOUTS.values())
    if layout == current.name == ZERO_PARTITIONS:  # DeepSpeed reads its own at their size and stage family only
        stage = _configured_zero_stage(trainer)
        state = step_folder / STATE_NAME
        if stage is None or loads_as_it_is_under_zero(state, manifest.world_size, world_size_of(trainer), stage):
            return None
    elif can_resume(layout, current):
        return None
    source = layout_named(layout)
    if can_resume(ONE_FILE, current) and source.consolidate is not None:
        return source
    raise BadInputError(
        f"ckpt_path: {step_folder} was written by {manifest.strategy} as {layout}, which the configured "
        "trainer.strategy cannot load: DeepSpeed resumes only its own partitions at the same world size. Resume it "
        "with ddp, fsdp or tp (any world size; converted as it loads), or turn it into one Lightning file of "
        f"weights with `python -m lightning_mlopt checkpoint consolidate {step_folder} <out.ckpt>`."
    )


def strategy_resumes(trainer: dict[str, Any], manifest: Manifest) -> bool:
    """Whether the configured strategy (a registered name or a class_path) can resume ``manifest``'s layout.

    True when the strategy's class cannot be told here (Lightning's own names): FaultTolerantCheckpoint judges.
    """
    from lightning_mlopt.checkpoint.layout import can_resume, layout_of_manifest
    from lightning_mlopt.strategies import LAYOUTS

    layout = _configured_layout(trainer)
    if layout is None:
        return True
    return can_resume(layout_of_manifest(manifest.layout, manifest.strategy, LAYOUTS.values()), layout)


def _configured_zero_stage(trainer: dict[str, Any]) -> int | None:
    """The ZeRO stage of the configured DeepSpeed strategy (ours, by name or class_path); None if unknown."""
    from lightning_mlopt.strategies import STRATEGIES
    from lightning_mlopt.strategies.deepspeed.deepspeed_strategy import zero_stage_of
    from lightning_mlopt.strategies.spec import REGISTRY_PREFIX

    strategy = trainer.get("strategy")
    if isinstance(strategy, str) and strategy.startswith(REGISTRY_PREFIX):
        arguments = STRATEGIES.get(strategy.removeprefix(REGISTRY_PREFIX), (None, {}))[1]
    elif isinstance(strategy, dict):
        arguments = strategy.get("init_args") or {}
    else:
        return None
    return zero_stage_of(str(arguments.get("preset", "zero2")), arguments.get("config"))


# Lightning's own strategy names whose checkpoints are one file (a single device, DDP and its variants).
_ONE_FILE_NAMES = ("auto", "single_device", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook")


def _configured_layout(trainer: dict[str, Any]) -> Any:
    """The checkpoint layout of the configured strategy (ours, or Lightning's one-file ones); None if unknown."""
    from lightning_mlopt.checkpoint.layout import ONE_FILE
    from lightning_mlopt.strategies import STRATEGIES, layout_named
    from lightning_mlopt.strategies.spec import REGISTRY_PREFIX

    strategy = trainer.get("strategy", "auto")
    if isinstance(strategy, str) and strategy.startswith(REGISTRY_PREFIX):
        strategy_class: Any = STRATEGIES.get(strategy.removeprefix(REGISTRY_PREFIX), (None,))[0]
    elif isinstance(strategy, str):
        return layout_named(ONE_FILE) if strategy in _ONE_FILE_NAMES else None
    else:
        strategy_class = imported_class(strategy.get("class_path")) if isinstance(strategy, dict) else None
    layout = getattr(strategy_class, "checkpoint_layout", None)
    return layout_named(layout) if isinstance(layout, str) else None


def imported_class(class_path: Any) -> type | None:
    """The class a ``class_path`` names, or None when it does not import (the parser reports that)."""
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None
