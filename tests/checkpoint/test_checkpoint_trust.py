"""Loading without trusting pickles: a crafted checkpoint is refused before any of its code runs."""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_mlopt.callbacks import FaultTolerantCheckpoint, Resume, SaveOn
from lightning_mlopt.checkpoint import CheckpointStore, Manifest, verify
from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, describe_files
from lightning_mlopt.checkpoint.serialization import load_file
from lightning_mlopt.checkpoint.trust import globals_in_pickle, untrusted_globals
from lightning_mlopt.exceptions import BadInputError
from tests.conftest import run_tool_here
from tests.support.models import ThirdPartyLM


class CreatesAFile:
    """Unpickling this creates ``path`` (a folder): what a crafted checkpoint would do with ``os.system``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.makedirs, (str(self.path),))


def _fit(root: Path, steps: int, **checkpoint_args) -> pl.Trainer:
    callback = FaultTolerantCheckpoint(
        dirpath=str(root / "ckpt"),
        every_n_steps=2,
        async_save=False,
        save_on=SaveOn(train_end=False),
        **checkpoint_args,
    )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[callback],
        default_root_dir=str(root),
    )
    trainer.fit(ThirdPartyLM(num_sequences=64))
    return trainer


def _plant(folder: Path, marker: Path) -> None:
    """Add a file-creating object to a committed checkpoint and re-checksum it, so its manifest verifies."""
    state = torch.load(folder / "state.ckpt", weights_only=False)
    state["planted"] = CreatesAFile(marker)
    torch.save(state, folder / "state.ckpt")
    manifest = Manifest.from_json((folder / MANIFEST_NAME).read_text())
    manifest.files = describe_files(folder)
    (folder / MANIFEST_NAME).write_text(manifest.to_json())
    verify(folder)  # the checksums cannot tell: the file is exactly what the manifest says


def test_a_crafted_checkpoint_is_refused_everywhere_and_loads_only_when_trusted(tmp_path, monkeypatch):
    # Hyperparameters saved by save_hyperparameters() (ordinary types) resume with the opt-in off.
    _fit(tmp_path, steps=2)
    resumed = _fit(tmp_path, steps=4)
    assert resumed.global_step == 4
    newest = CheckpointStore(tmp_path / "ckpt").newest_valid()
    assert newest is not None and newest.step == 4
    marker = tmp_path / "created-by-the-pickle"
    _plant(newest.path, marker)
    assert [f.name for f in untrusted_globals(newest.path)] == ["os.makedirs"]

    # Auto-resume: refused on every rank before anything is unpickled (the CLI exits 2), naming the setting as the
    # script wrote the callback (the CLI says checkpoint.resume.trust_pickles: true).
    trusting = r"FaultTolerantCheckpoint\(resume=Resume\(trust_pickles=True\)\)"
    with pytest.raises(BadInputError, match=rf"os\.makedirs \(in state\.ckpt:.*set {trusting} \(checkpoint tool"):
        _fit(tmp_path, steps=6)
    assert not marker.exists()
    # The checkpoint tool: consolidate and export refuse it likewise (exit 2), nothing written.
    for command in (
        ["consolidate", str(newest.path), str(tmp_path / "out.ckpt")],
        ["export", str(newest.path), str(tmp_path / "out")],
    ):
        result = run_tool_here("checkpoint", command, tmp_path, monkeypatch)
        assert result.returncode == 2, result.stderr
        assert "os.makedirs" in result.stderr and "--trust-pickles" in result.stderr
        assert not marker.exists()
    assert not (tmp_path / "out.ckpt").exists() and not (tmp_path / "out").exists()
    # `list` and `verify` never unpickle.
    assert run_tool_here("checkpoint", ["verify", str(newest.path)], tmp_path, monkeypatch).returncode == 0
    assert not marker.exists()

    # Opted in: it loads (and the pickle's code runs: that is what trusting means).
    trusted = run_tool_here(
        "checkpoint",
        ["consolidate", "--trust-pickles", str(newest.path), str(tmp_path / "out.ckpt")],
        tmp_path,
        monkeypatch,
    )
    assert trusted.returncode == 0, trusted.stderr
    assert marker.exists()
    marker.rmdir()
    assert _fit(tmp_path, steps=6, resume=Resume(trust_pickles=True)).global_step == 6
    assert marker.exists()


def test_the_dry_run_follows_the_real_stack_not_the_last_strings_pushed():
    # PROTO 4; push "builtins", "open"; push "collections", "OrderedDict"; TUPLE2 (pops the last two); POP;
    # STACK_GLOBAL now takes builtins.open although the last strings pushed name an allowed class.
    crafted = (
        b"\x80\x04"
        + b"\x8c\x08builtins\x8c\x04open"
        + b"\x8c\x0bcollections\x8c\x0bOrderedDict\x86"
        + b"0"  # POP
        + b"\x93"  # STACK_GLOBAL
        + b"N\x85R."  # call it with (None,) and stop
    )
    pickletools.dis(crafted, out=io.StringIO())  # a well-formed pickle
    assert globals_in_pickle(crafted) == ["builtins.open"]
    for protocol in (0, 2, 4, 5):
        names = globals_in_pickle(pickle.dumps(CreatesAFile(Path("x")), protocol=protocol))
        assert names == ["os.makedirs"], (protocol, names)


def test_rng_and_state_files_load_with_weights_only(tmp_path):
    _fit(tmp_path, steps=2)
    newest = CheckpointStore(tmp_path / "ckpt").newest_valid()
    assert newest is not None
    assert untrusted_globals(newest.path) == []
    rng = load_file(newest.path / "rng" / "rank-0.pt")  # weights_only=True: numpy's RNG state is allowlisted
    assert rng["numpy"][0] == "MT19937"
    assert load_file(newest.path / "state.ckpt")["hyper_parameters"]["n_embd"] == 32


def test_manifests_written_with_sha256_still_verify(tmp_path):
    import hashlib

    folder = tmp_path / "step-000000002"
    folder.mkdir()
    (folder / "state.ckpt").write_bytes(b"weights")
    old = {
        "step": 2, "epoch": 0, "world_size": 1, "strategy": "DDPStrategy", "reason": "every_n_steps",
        "final": False, "metric": None, "versions": {}, "run_ids": {}, "created": 0.0, "format_version": 1,
        "files": {"state.ckpt": {"size": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}},
    }  # fmt: skip
    (folder / MANIFEST_NAME).write_text(json.dumps(old))
    assert verify(folder).checksum == "sha256"
    (folder / "state.ckpt").write_bytes(b"WEIGHTS")
    with pytest.raises(Exception, match="does not match its checksum"):
        verify(folder)
    os.remove(folder / "state.ckpt")
