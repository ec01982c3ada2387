"""``fit --ckpt_path`` is the warm start of a run with no checkpoint of its own (issue 64, item 1).

A requeued job carries its ``--ckpt_path``: each launch must resume from what the run saved last, not restart
from the warm start. The decision (``checkpoint/warm_start.py``) in-process; then the real CLI, requeued three
times on one process and twice on two, against an uninterrupted run; ``resume.ckpt_path: always`` still rolls
back (``tests/callbacks/test_fault_tolerant_checkpoint.py``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from lightning_mlopt.checkpoint import CheckpointStore, Manifest
from lightning_mlopt.checkpoint.manifest import describe_files
from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
from lightning_mlopt.checkpoint.remote.object_store import ObjectStore
from lightning_mlopt.checkpoint.serialization import load_file
from lightning_mlopt.checkpoint.store import ROLLED_BACK_DIR, STATE_NAME
from lightning_mlopt.checkpoint.warm_start import WarmStart, own_newest
from lightning_mlopt.cli import main
from lightning_mlopt.cli.ckpt_path import prefer_own_checkpoint, resolve_ckpt_path
from lightning_mlopt.cli.support import finished_run
from lightning_mlopt.run_dir import config_fingerprint
from tests.conftest import CONFIGS, run_cli
from tests.support.faults import kill_job_when

WARM = "/runs/a/checkpoints/step-000000010"


def _commit(root: Path, step: int, final: bool = False) -> Path:
    """A committed checkpoint as the saver leaves one (a state file, a manifest with sizes and checksums)."""
    store = CheckpointStore(root)
    staging = store.stage(step)
    (staging / STATE_NAME).write_bytes(os.urandom(256))
    manifest = Manifest(step=step, epoch=0, world_size=1, strategy="DDPStrategy", reason="every_n_steps", final=final)
    manifest.files = describe_files(staging)
    return store.commit(staging, manifest)


def _config(given: str | None, **resume: object) -> Namespace:
    return Namespace(ckpt_path=given, checkpoint=Namespace(dirpath=None, tiers=None, resume=Namespace(**resume)))


def test_the_runs_own_checkpoint_wins_unless_always_and_each_choice_says_why():
    own = (40, "runs/b/checkpoints/step-000000040")
    requeued = WarmStart(WARM, own)
    assert not requeued.loads_given
    assert requeued.line() == (
        "ckpt_path: resuming from this run's own step 40 (runs/b/checkpoints/step-000000040); "
        f"{WARM} is the warm start of a run with no checkpoint of its own; to load it instead, set "
        "FaultTolerantCheckpoint(resume=Resume(ckpt_path='always'))"  # a script's spelling; the CLI's: YAML keys
    )
    first = WarmStart(WARM, None)
    assert first.loads_given and f"no checkpoint of its own yet: starting from {WARM}" in first.line()
    forced = WarmStart(WARM, own, "always")
    assert forced.loads_given and "not this run's own step 40" in forced.line() and ROLLED_BACK_DIR in forced.line()
    assert WarmStart(WARM, None, "always").loads_given
    last = WarmStart("last", own)  # `last` names the run's own newest: said as such, not as a warm start
    assert not last.loads_given and last.line() == (
        "ckpt_path: last: resuming from this run's own newest checkpoint, step 40 (runs/b/checkpoints/step-000000040)"
    )
    with pytest.raises(ValueError, match=r"resume\.ckpt_path must be 'warm_start' or 'always', got 'newest'"):
        WarmStart(WARM, own, "newest")  # type: ignore[arg-type]


def test_own_newest_takes_the_newest_intact_folder_and_never_a_node_local_tier(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    config = _config(WARM).checkpoint
    assert own_newest(config, run_dir) is None  # no folder yet: a first launch
    _commit(checkpoints, 4)
    newest = _commit(checkpoints, 6)
    CheckpointStore(checkpoints).stage(8)  # an interrupted save: no commit
    (checkpoints / ROLLED_BACK_DIR / "t" / "step-000000009").mkdir(parents=True)  # an abandoned branch
    assert own_newest(config, run_dir) == (6, str(newest))
    (newest / STATE_NAME).write_bytes(b"cut")  # truncated: the sizes tell, without a checksum
    assert own_newest(config, run_dir) == (4, str(checkpoints / "step-000000004"))
    elsewhere = _config(WARM).checkpoint
    elsewhere.dirpath = str(tmp_path / "shared")
    assert own_newest(elsewhere, run_dir) is None, "checkpoint.dirpath is where the run's own checkpoints are"
    # A node-local tier may hold checkpoints on one node and none on another: no rank may judge by it alone.
    local = Namespace(dirpath="s3://bucket/run", tiers=Namespace(local_dirpath=str(checkpoints)))
    monkeypatch.setattr("lightning_mlopt.checkpoint.warm_start._newest_in_store", lambda url: None)
    assert own_newest(local, run_dir) is None


@pytest.mark.slow
def test_own_newest_reads_the_object_store_every_node_sees(s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/runs/b"
    remote = RemoteCheckpoints(ObjectStore.for_url(url, max_attempts=3))
    remote.upload(_commit(tmp_path / "uploaded", 12))
    checkpoint = Namespace(dirpath=url, tiers=Namespace(local_dirpath=str(tmp_path / "node-local")))
    _commit(tmp_path / "node-local", 14)  # this node's tier, newer: not counted (another node has none)
    assert own_newest(checkpoint, tmp_path / "run") == (12, f"{url}/step-000000012")
    missing = Namespace(dirpath=f"s3://{s3_bucket}-none/runs/b", tiers=None)
    with pytest.raises(Exception, match="cannot tell whether this run has checkpoints of its own"):
        own_newest(missing, tmp_path / "run")


def test_the_cli_drops_a_ckpt_path_the_runs_own_checkpoint_beats_before_reading_or_converting_it(tmp_path):
    run_dir = tmp_path / "run"
    assert prefer_own_checkpoint(_config(None), run_dir) is None
    first = _config(str(tmp_path / "missing"))
    assert "no checkpoint of its own yet" in prefer_own_checkpoint(first, run_dir)
    assert first["ckpt_path"] == str(tmp_path / "missing"), "a first launch loads it"
    _commit(run_dir / "checkpoints", 2)
    requeued = _config(str(tmp_path / "missing"))  # the warm start may be gone by now: it is never read
    assert "resuming from this run's own step 2" in prefer_own_checkpoint(requeued, run_dir)
    assert requeued["ckpt_path"] is None and resolve_ckpt_path(requeued, run_dir) is None
    assert not (run_dir / "checkpoints" / "converted").exists()
    forced = _config(WARM, ckpt_path="always")
    assert "(FaultTolerantCheckpoint(resume=Resume(ckpt_path='always')))" in prefer_own_checkpoint(forced, run_dir)
    assert forced["ckpt_path"] == WARM
    manual = _config(WARM, auto=False)  # no auto-resume: the given path is all there is
    assert prefer_own_checkpoint(manual, run_dir) is None and manual["ckpt_path"] == WARM
    # The setting says how to run, not what: relaunching with it must land in the same run directory.
    assert config_fingerprint({"checkpoint": {"resume": {"ckpt_path": "always"}}}) == config_fingerprint(
        {"checkpoint": {"resume": {"ckpt_path": "warm_start"}}}
    )


def test_a_finished_run_stays_finished_with_its_warm_start_on_the_command_line(tmp_path):
    run_dir = tmp_path / "run"
    _commit(run_dir / "checkpoints", 8, final=True)

    def config(given: str, **resume: object) -> dict:
        return {"ckpt_path": given, "checkpoint": {"resume": resume}, "trainer": {}}

    assert "this run already finished at step 8" in finished_run(config(WARM), run_dir)
    assert finished_run(config(WARM, ckpt_path="always"), run_dir) is None, "always: it trains from the path"


# --------------------------------------------------------------------------- the real CLI, requeued

QUIET = [
    "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.logger=false",
    "--checkpoint.every_n_steps=2",
    "--checkpoint.async_save=false",
]


def _args(run_dir: Path, steps: int, *extra: str) -> list[str]:
    config = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), f"--run_dir={run_dir}"]
    return [*config, f"--trainer.max_steps={steps}", *QUIET, *extra]


def _launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """One launch of the command, forked from the preloaded server: what a requeue starts is the subject here."""
    return run_cli(args, cwd, preloaded=True)


def _warm_start(tmp_path: Path) -> Path:
    """Another run's checkpoint at step 2 (mid-epoch; that run went on to step 4)."""
    main(_args(tmp_path / "a", 4))
    return tmp_path / "a" / "checkpoints" / "step-000000002"


def _steps(run_dir: Path) -> list[int]:
    return [step for step, _ in CheckpointStore(run_dir / "checkpoints").committed()]


def _same_parameters(run_dir: Path, reference: Path, step: int) -> None:
    """The final checkpoints hold the same weights, bitwise (CPU, deterministic)."""
    (ours, theirs) = (
        load_file(d / "checkpoints" / f"step-{step:09d}" / STATE_NAME, False) for d in (run_dir, reference)
    )
    assert ours["global_step"] == theirs["global_step"] == step
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    for name, tensor in theirs["state_dict"].items():
        assert torch.equal(ours["state_dict"][name], tensor), f"{name} differs from the uninterrupted run"


@pytest.mark.slow
def test_a_requeued_command_with_ckpt_path_progresses_from_its_own_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    warm = _warm_start(tmp_path)
    # SIGTERM at step 5, and at step 8 (a resumed launch no longer passes step 5): a scheduler's preemptions.
    signals = [
        f"--trainer.callbacks{arg}"
        for step in (5, 8)
        for arg in ("+=tests.support.faults.SignalAtStep", f".step={step}")
    ]
    command = _args(tmp_path / "b", 10, f"--ckpt_path={warm}", *signals)
    run_dir = tmp_path / "b"

    first = _launch(command, tmp_path)  # SIGTERM at step 5: saved, exit 75, the scheduler requeues
    assert first.returncode == 75, first.stderr[-3000:]
    assert f"ckpt_path: this run has no checkpoint of its own yet: starting from {warm}" in first.stdout
    assert _steps(run_dir) == [4, 5]
    for launch, (resumed, newest, status) in enumerate([(5, 8, 75), (8, 10, 0)], start=2):
        done = _launch(command, tmp_path)  # the same command, --ckpt_path and all
        assert done.returncode == status, f"launch {launch}:\n{done.stderr[-3000:]}"
        own = run_dir / "checkpoints" / f"step-{resumed:09d}"
        assert (
            f"ckpt_path: resuming from this run's own step {resumed} ({own}); {warm} is the warm start" in done.stdout
        )
        assert "set checkpoint.resume.ckpt_path: always" in done.stdout
        assert f"Auto-resuming from {own} (step {resumed}" in done.stderr
        assert str(warm) not in done.stderr, "the warm start was not loaded again"
        assert _steps(run_dir)[-1] == newest
    assert not (run_dir / "checkpoints" / ROLLED_BACK_DIR).exists(), "nothing of the run was set aside"
    assert CheckpointStore(run_dir / "checkpoints").newest_valid().manifest.final

    reference = _launch(_args(tmp_path / "c", 10, f"--ckpt_path={warm}"), tmp_path)  # uninterrupted
    assert reference.returncode == 0, reference.stderr[-3000:]
    _same_parameters(run_dir, tmp_path / "c", 10)

    again = _launch(command, tmp_path)  # a requeue of the finished run: nothing to do
    assert again.returncode == 0 and "this run already finished at step 10" in again.stderr, again.stderr[-3000:]
    assert _steps(run_dir)[-1] == 10

    # Forced: the warm start wins over the finished run, whose checkpoints past its step are moved aside.
    forced = _launch([*command, "--trainer.max_steps=3", "--checkpoint.resume.ckpt_path=always"], tmp_path)
    assert forced.returncode == 0, forced.stderr[-3000:]
    own = run_dir / "checkpoints" / "step-000000010"
    assert f"ckpt_path: loading {warm} (checkpoint.resume.ckpt_path: always), not this run's own step 10 ({own})" in (
        forced.stdout
    )
    assert "Rolled back to step 2: the 3 newer checkpoints of this run were moved to" in forced.stderr
    assert _steps(run_dir) == [3]
    (aside,) = (run_dir / "checkpoints" / ROLLED_BACK_DIR).iterdir()
    assert sorted(path.name for path in aside.iterdir()) == [f"step-{s:09d}" for s in (6, 8, 10)]


def _kill_after_commit(args: list[str], cwd: Path, run_dir: Path, after: int) -> None:
    """Launch the job (forked, preloaded); SIGKILL every process of it once a checkpoint newer than ``after``
    is committed."""

    def committed_past_after() -> bool:
        return any(step > after for step in _steps(run_dir))

    kill_job_when(args, cwd, committed_past_after, f"a checkpoint past step {after}", preloaded=True)


@pytest.mark.multiprocess
def test_two_processes_requeued_with_ckpt_path_resume_from_their_own_checkpoint(tmp_path, monkeypatch):
    """Every rank decides alone, before the Trainer: they must agree (else their states would differ)."""
    monkeypatch.chdir(tmp_path)
    warm = _warm_start(tmp_path)  # one process wrote it: one file, loaded at any world size
    ddp = ["--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accelerator=cpu", f"--ckpt_path={warm}"]
    run_dir = tmp_path / "b"
    command = _args(run_dir, 8, *ddp)

    _kill_after_commit(command, tmp_path, run_dir, after=2)  # killed mid-run, after its first commit (step 4)
    killed_at = _steps(run_dir)[-1]
    assert 4 <= killed_at < 8 and not CheckpointStore(run_dir / "checkpoints").newest_valid().manifest.final
    done = _launch(command, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"ckpt_path: resuming from this run's own step {killed_at} " in done.stdout
    assert done.stdout.count("is the warm start of a run with no checkpoint of its own") == 1, "said by rank zero"
    assert f"Auto-resuming from {run_dir / 'checkpoints' / f'step-{killed_at:09d}'}" in done.stderr

    reference = _launch(_args(tmp_path / "c", 8, *ddp), tmp_path)
    assert reference.returncode == 0, reference.stderr[-4000:]
    _same_parameters(run_dir, tmp_path / "c", 8)
