"""choose_checkpoint alone, on checkpoint folders made here: what rank zero resumes from, and why not.

The whole-run tests (kills, signals, strategy switches) go through it; these pin each branch without a Trainer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mlopt.checkpoint import CheckpointStore, Manifest
from lightning_mlopt.checkpoint.layout import DCP_SHARDS, ONE_FILE, ZERO_PARTITIONS
from lightning_mlopt.checkpoint.manifest import describe_files
from lightning_mlopt.checkpoint.resume import ResumingStrategy, choose_checkpoint, converted_for
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies import LAYOUTS

KNOWN = tuple(LAYOUTS.values())
DDP = ResumingStrategy("DDPStrategy", LAYOUTS[ONE_FILE], KNOWN)


class _NotOnTheAllowlist:
    """A type no lightning_mlopt checkpoint holds: unpickling it could run any code its module has."""


def _commit(store: CheckpointStore, step: int, layout: str = ONE_FILE, strategy: str = "DDPStrategy", **fields) -> Path:
    staging = store.stage(step)
    torch.save({"global_step": step, "state_dict": {"w": torch.full((2,), float(step))}}, staging / "state.ckpt")
    manifest = Manifest(step=step, epoch=0, world_size=2, strategy=strategy, reason="every_n_steps", layout=layout)
    manifest.files = describe_files(staging)
    manifest.final = fields.get("final", False)
    store.commit(staging, manifest)
    return store.root / CheckpointStore.name_for(step)


def test_nothing_to_resume_from_is_none(tmp_path: Path) -> None:
    assert choose_checkpoint(CheckpointStore(tmp_path / "checkpoints"), DDP, False, False) is None


def test_the_newest_that_verifies_is_chosen_and_a_damaged_one_is_skipped_with_a_warning(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    older = _commit(store, 10)
    newest = _commit(store, 20)
    assert choose_checkpoint(store, DDP, False, False).path == newest  # type: ignore[union-attr]
    (newest / "state.ckpt").write_bytes(b"truncated")
    with pytest.warns(UserWarning, match=r"step-000000020 failed verification .*trying an older one"):
        choice = choose_checkpoint(store, DDP, False, False)
    assert choice is not None and choice.path == older and not choice.stays_final and choice.refusal is None


def test_an_interrupted_save_is_removed_and_never_chosen(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    done = _commit(store, 10)
    staging = store.stage(20)
    (staging / "state.ckpt").write_bytes(b"half")
    choice = choose_checkpoint(store, DDP, False, False)
    assert choice is not None and choice.path == done and not staging.exists()


def test_a_final_checkpoint_stays_finished_unless_resume_final(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    final = _commit(store, 30, final=True)
    stays = choose_checkpoint(store, DDP, False, resume_final=False)
    assert stays is not None and stays.path == final and stays.stays_final
    trains_on = choose_checkpoint(store, DDP, False, resume_final=True)
    assert trains_on is not None and trains_on.path == final and not trains_on.stays_final


@pytest.mark.parametrize(
    ("saved_layout", "saved_by", "current", "refused"),
    [
        (ONE_FILE, "DDPStrategy", ResumingStrategy("FSDPStrategy", LAYOUTS[DCP_SHARDS], KNOWN), False),
        (DCP_SHARDS, "FSDPStrategy", ResumingStrategy("FSDPStrategy", LAYOUTS[DCP_SHARDS], KNOWN), False),
        (ONE_FILE, "DDPStrategy", ResumingStrategy("ZeROStrategy", LAYOUTS[ZERO_PARTITIONS], KNOWN), False),
        ("the format of OwnFormat", "OwnFormat", DDP, True),  # no strategy of ours reads it: nothing converts it
    ],
)
def test_a_layout_the_strategy_cannot_read_is_refused_in_one_line(
    tmp_path: Path, saved_layout: str, saved_by: str, current: ResumingStrategy, refused: bool
) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    path = _commit(store, 10, layout=saved_layout, strategy=saved_by)
    choice = choose_checkpoint(store, current, False, False)
    assert choice is not None
    if not refused:
        assert choice.path == path and choice.refusal is None
        return
    assert choice.path is None and choice.refusal is not None and "\n" not in choice.refusal
    assert choice.refusal.startswith(
        f"cannot resume {path} (written by {saved_by} on 2 processes: {saved_layout}) with {current.name}"
    )
    assert path.exists()  # refused, never touched


def test_zero_partitions_load_as_they_are_only_where_deepspeed_reads_them(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    path = _commit(store, 10, layout=ZERO_PARTITIONS, strategy="DeepSpeedStrategy")  # world size 2
    on_two = ResumingStrategy("DeepSpeedStrategy", LAYOUTS[ZERO_PARTITIONS], KNOWN, lambda _, saved: saved == 2)
    chosen = choose_checkpoint(store, on_two, False, False)
    assert chosen is not None and chosen.path == path and chosen.convert_from is None
    # Another world size (or stage family): converted on every rank after the choice is shared.
    on_one = ResumingStrategy("DeepSpeedStrategy", LAYOUTS[ZERO_PARTITIONS], KNOWN, lambda _, saved: saved == 1)
    chosen = choose_checkpoint(store, on_one, False, False)
    assert chosen is not None and chosen.path == path and chosen.convert_from == ZERO_PARTITIONS


def test_a_checkpoint_that_cannot_be_converted_is_refused_in_one_line_and_left_alone(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    path = _commit(store, 10, layout=ZERO_PARTITIONS, strategy="DeepSpeedStrategy")  # a file, not ZeRO's folder
    choice = choose_checkpoint(store, DDP, False, False)
    assert choice is not None and choice.path == path and choice.convert_from == ZERO_PARTITIONS
    with pytest.raises(BadInputError) as refused:
        converted_for(choice, DDP, store.root, trust_pickles=False)
    message = str(refused.value)
    assert message.startswith(f"cannot convert {path} (ZeRO partitions) for DDPStrategy: ") and "\n" not in message
    assert path.exists() and not (store.root / "converted" / path.name).exists()


def test_a_checkpoint_naming_an_unknown_type_is_refused_unless_trusted(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    staging = store.stage(10)
    torch.save({"global_step": 10, "callback": _NotOnTheAllowlist()}, staging / "state.ckpt")
    manifest = Manifest(step=10, epoch=0, world_size=1, strategy="DDPStrategy", reason="signal", layout=ONE_FILE)
    manifest.files = describe_files(staging)
    path = store.commit(staging, manifest) or store.root / CheckpointStore.name_for(10)
    refused = choose_checkpoint(store, DDP, trust_pickles=False, resume_final=False)
    assert refused is not None and refused.path is None and "_NotOnTheAllowlist" in (refused.refusal or "")
    trusted = choose_checkpoint(store, DDP, trust_pickles=True, resume_final=False)
    assert trusted is not None and trusted.path == path
