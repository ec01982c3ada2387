"""What ``--ckpt_path`` may name besides a Lightning file: our step folders, checkpoints folders, run folders.

``fit``, ``validate``, ``test`` and ``predict`` all take ``ckpt_path``. Lightning understands a file (or a
strategy's folder) and its own ``last``/``best``; FaultTolerantCheckpoint writes ``step-N/`` folders with a
manifest. This turns any of these into the path Lightning loads, after verifying the manifest's checksums:

- a step folder ``<run>/checkpoints/step-000000010`` -> its ``state.ckpt``;
- a checkpoints folder, or a run folder holding one -> its newest checkpoint that verifies;
- ``last`` -> the newest valid checkpoint of this run; ``best`` -> the best by the monitored metric
  (``checkpoint.keep.monitor``), when this run has checkpoints of ours (else Lightning's meaning);
- ``<step folder>/state.ckpt`` -> itself, once its folder verified.

Example::

    resolve_checkpoint_path("runs/gpt-1a2b3c4d/checkpoints", own_dir=Path("runs/gpt-1a2b3c4d/checkpoints"))
    # -> ("runs/gpt-1a2b3c4d/checkpoints/step-000000500/state.ckpt", "step 500, saved by every_n_steps")
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path

from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, Manifest, verify
from lightning_mlopt.checkpoint.store import STATE_NAME, CheckpointEntry, CheckpointStore
from lightning_mlopt.exceptions import BadInputError, CheckpointInvalidError
from lightning_mlopt.run_dir import CHECKPOINTS_DIR


def resolve_checkpoint_path(value: str, own_dir: Path | None, mode: str = "min") -> tuple[str, str | None]:
    """The path Lightning should load for ``ckpt_path: value``, and a description (None when left as given).

    Args:
        value: what the user gave.
        own_dir: this run's checkpoints folder (for ``last``/``best``).
        mode: ``min`` or ``max``: which monitored values are best.

    Raises:
        BadInputError: a folder of ours that holds no checkpoint that verifies, or a step folder that fails.

    """
    if value in ("last", "best"):
        if own_dir is None or not CheckpointStore(own_dir).committed():
            return value, None  # Lightning's own meaning (ModelCheckpoint's last/best)
        entry = _newest(CheckpointStore(own_dir), own_dir) if value == "last" else _best(own_dir, mode)
        return _state(entry)
    path = Path(value)
    if path.name == STATE_NAME and (path.parent / MANIFEST_NAME).is_file():
        return _state(_verified(path.parent))
    if not path.is_dir():
        return value, None
    if (path / MANIFEST_NAME).is_file():
        return _state(_verified(path))
    for folder in (path, path / CHECKPOINTS_DIR):
        store = CheckpointStore(folder)
        if store.committed():
            return _state(_newest(store, folder))
    return value, None


# What Lightning's own ckpt_path takes besides a path: ModelCheckpoint's last/best, SLURM's hpc, a model registry.
_LIGHTNING_NAMES = ("last", "best", "hpc")
_STEP_NAME = re.compile(r"^step-0*(\d+)$")


def refuse_missing(value: str) -> None:
    """Raise BadInputError when ``ckpt_path`` names a local path that does not exist, with the likely one.

    Left to Lightning: its names (``last``, ``best``, ``hpc``, ``registry:...``) and URLs. Before any file of
    the run is written: a mistyped path must not relaunch a run (and replace its config.yaml) only to fail.

    Example::

        >>> refuse_missing("last")
        >>> refuse_missing("/no/such/run/checkpoints/step-66")
        Traceback (most recent call last):
        ...
        lightning_mlopt.exceptions.BadInputError: ckpt_path: /no/such/run/checkpoints/step-66 does not exist; ...
    """
    if value in _LIGHTNING_NAMES or value.startswith("registry") or "://" in value:
        return
    path = Path(value)
    if path.exists():
        return
    hint = ""
    if path.parent.is_dir():
        names = sorted(child.name for child in path.parent.iterdir())
        numbered = _STEP_NAME.match(path.name)
        padded = CheckpointStore.name_for(int(numbered.group(1))) if numbered else None
        close = [padded] if padded in names else difflib.get_close_matches(path.name, names, n=1)
        hint = f" (did you mean {path.parent / close[0]}?)" if close else ""
    raise BadInputError(
        f"ckpt_path: {value} does not exist{hint}; name a checkpoint file, a step folder (step-000000500), a "
        "checkpoints folder, a run folder, or last/best"
    )


def _verified(folder: Path) -> CheckpointEntry:
    try:
        manifest = verify(folder)
    except CheckpointInvalidError as error:
        raise BadInputError(f"ckpt_path: {folder} failed verification ({error}); nothing was loaded") from None
    return CheckpointEntry(folder, manifest.step, manifest, None)


def _newest(store: CheckpointStore, folder: Path) -> CheckpointEntry:
    entry = store.newest_valid()
    if entry is None:
        raise BadInputError(
            f"ckpt_path: no checkpoint in {folder} verifies (see: python -m lightning_mlopt checkpoint list)"
        )
    return entry


def _best(folder: Path, mode: str) -> CheckpointEntry:
    scored = []
    for entry in CheckpointStore(folder).entries():
        metric = entry.manifest.metric if entry.valid and entry.manifest is not None else None
        if metric is not None and math.isfinite(float(metric["value"])):  # a NaN is no one's best
            scored.append((float(metric["value"]), entry))
    if not scored:
        raise BadInputError(
            f"ckpt_path: best: no checkpoint in {folder} records a metric; set checkpoint.keep.monitor when training, "
            "or name a step folder"
        )
    return (min if mode == "min" else max)(scored, key=lambda pair: pair[0])[1]


def _state(entry: CheckpointEntry) -> tuple[str, str]:
    manifest: Manifest | None = entry.manifest
    reason = f", saved by {manifest.reason}" if manifest is not None else ""
    return str(entry.path / STATE_NAME), f"{entry.path} (step {entry.step}{reason})"
