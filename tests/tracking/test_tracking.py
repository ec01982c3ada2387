"""Experiment tracking: W&B offline (read back), secrets kept out of every output, provenance, progress bar."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

import lightning_mlopt
from lightning_mlopt.callbacks.throughput_progress_bar import ThroughputMeter, count_items, format_rate
from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.checkpoint.manifest import Manifest
from lightning_mlopt.cli import main
from lightning_mlopt.distributed.fingerprint import collect_fingerprint
from lightning_mlopt.redaction import REDACTED, is_secret_name, redact, secret_values
from lightning_mlopt.tracking import WandbTracker
from lightning_mlopt.tracking.provenance import git_state
from tests.conftest import CONFIGS, SMOKE, run_cli, start_cli
from tests.support.wandb_records import summary_of

QUICK = ["fit", "--config", str(CONFIGS / "quickstart.yaml")]
WANDB = ["--config", str(CONFIGS / "trackers" / "wandb.yaml")]


# ---------------------------------------------------------------------- secrets and provenance


def test_redact_replaces_secret_keys_url_credentials_and_secret_values_anywhere():
    secrets = ["hunter2-very-secret"]
    value = {
        "remote": "https://alice:ghp_token@github.com/lab/repo.git",
        "password": "x",
        "nested": [{"note": "key is hunter2-very-secret!"}, ("a", 1)],
        "lr": 0.1,
    }
    assert redact(value, secrets) == {
        "remote": f"https://{REDACTED}@github.com/lab/repo.git",
        "password": REDACTED,
        "nested": [{"note": f"key is {REDACTED}!"}, ("a", 1)],
        "lr": 0.1,
    }
    assert is_secret_name("HF_TOKEN") and is_secret_name("aws_secret_access_key") and not is_secret_name("NCCL_DEBUG")
    assert secret_values({"MY_TOKEN": "abcdefgh", "SHORT_KEY": "1", "PATH": "/usr/bin/longish"}) == ["abcdefgh"]


def test_fingerprint_redacts_a_secret_named_nccl_variable(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("NCCL_TEST_AUTH_TOKEN", "planted-nccl-secret")
    fingerprint = collect_fingerprint()
    assert fingerprint["env:NCCL_SOCKET_IFNAME"] == "eth0"
    assert fingerprint["env:NCCL_TEST_AUTH_TOKEN"] == REDACTED


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _make_repo(folder: Path, remote: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    _git(folder, "init", "-q")
    _git(folder, "config", "user.email", "t@example.com")
    _git(folder, "config", "user.name", "t")
    _git(folder, "remote", "add", "origin", remote)
    (folder / "train.py").write_text("print('v1')\n")
    _git(folder, "add", "train.py")
    _git(folder, "commit", "-q", "-m", "v1")
    return _git(folder, "rev-parse", "HEAD")


def test_git_state_names_the_commit_the_dirty_flag_and_a_remote_without_credentials(tmp_path, monkeypatch):
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    commit = _make_repo(repo, "https://bob:planted-git-token@example.com/lab/repo.git")
    state = git_state(repo)
    assert state == {"commit": commit, "dirty": False, "remote": f"https://{REDACTED}@example.com/lab/repo.git"}
    (repo / "train.py").write_text("print('v2')\n")
    assert git_state(repo)["dirty"] is True
    # Outside any repository (git may not look above tmp_path): every field is None, nothing raises.
    outside.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert git_state(outside) == {"commit": None, "dirty": None, "remote": None}


# ---------------------------------------------------------------------- W&B logger, unit


def test_mode_auto_is_offline_without_a_key_and_online_with_one(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no `wandb login` here
    tracker = WandbTracker(save_dir=str(tmp_path))
    assert tracker.resolved_mode() == "offline"
    assert "wandb sync" in tracker.describe_location()
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    assert tracker.resolved_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert tracker.resolved_mode() == "disabled"
    assert WandbTracker(mode="offline").resolved_mode() == "offline"
    with pytest.raises(ValueError, match="mode must be one of"):
        WandbTracker(mode="cloud")  # type: ignore[arg-type]


@pytest.mark.slow
def test_auto_with_credentials_but_no_route_to_the_server_logs_offline_instead_of_failing(monkeypatch, tmp_path):
    # A netrc on a shared home, a compute node without internet: wandb.init gives up after init_timeout.
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(save_dir=str(tmp_path), project="p")
    assert tracker.resolved_mode() == "online"
    with pytest.warns(UserWarning, match=r"W&B could not be reached \(.*\); logging offline instead: .*wandb sync"):
        run = tracker.experiment
    try:
        tracker.log_metrics({"loss": 1.0}, step=0)
        assert run.settings.mode == "offline" and list((tmp_path / "wandb").glob("offline-run-*"))
    finally:
        tracker._finish()
    import wandb

    explicit = WandbTracker(save_dir=str(tmp_path / "explicit"), project="p", mode="online")
    try:
        with pytest.raises(wandb.errors.CommError, match=r"127\.0\.0\.1"):  # asked for online: not ours to soften
            _ = explicit.experiment
    finally:
        # wandb.init started a service for this process and named it in os.environ (WANDB_SERVICE): a later test's
        # subprocess would join it. Stopped, and forgotten.
        wandb.teardown()
        os.environ.pop("WANDB_SERVICE", None)


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # free, and nobody listens there once closed


def test_the_run_id_comes_from_the_newest_checkpoint_that_records_one(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints")
    for step, run_ids in ((2, {"wandb": "older"}), (4, {"wandb": "newest"}), (6, {})):
        staging = store.stage(step)
        store.commit(staging, Manifest(step=step, epoch=0, world_size=1, strategy="x", reason="t", run_ids=run_ids))
    assert store.recorded_run_id("wandb") == "newest"
    assert WandbTracker(save_dir=str(tmp_path))._choose_run_id() == "newest"
    assert WandbTracker(save_dir=str(tmp_path), id="fixed")._choose_run_id() == "fixed"
    assert WandbTracker(save_dir=str(tmp_path / "elsewhere"))._choose_run_id() is None


def test_the_run_id_recorded_at_creation_continues_a_run_with_no_checkpoint_of_its_own(tmp_path):
    # A launch killed before its first commit, or checkpoints in another dirpath: the save folder's record wins.
    from lightning_mlopt.tracking.wandb_tracker import record_run_id

    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    store.commit(store.stage(2), Manifest(step=2, epoch=0, world_size=1, strategy="x", reason="t", run_ids={}))
    record_run_id(tmp_path / "run" / "wandb", "created")
    assert WandbTracker(save_dir=str(tmp_path / "run"))._choose_run_id() == "created"
    elsewhere = str(tmp_path / "other-checkpoints")
    assert WandbTracker(save_dir=str(tmp_path / "run"), checkpoint_dir=elsewhere)._choose_run_id() == "created"
    assert WandbTracker(save_dir=str(tmp_path / "another-run"))._choose_run_id() is None  # unrelated runs apart
    (tmp_path / "run" / "wandb" / "run.json").write_text("{not json")
    assert WandbTracker(save_dir=str(tmp_path / "run"))._choose_run_id() is None  # unreadable: never a crash


# ---------------------------------------------------------------------- W&B end to end (offline, read back)


def _wandb_env(tmp_path: Path) -> dict[str, str]:
    """W&B offline, with every folder it writes inside the test's tmp_path (so all of it is searched)."""
    home = tmp_path / "wandb-home"
    return {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(home / "dir"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        "WANDB_SILENT": "true",
    }


def _offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


@pytest.mark.multiprocess
def test_wandb_offline_one_run_per_job_continued_on_relaunch_and_no_secret_in_any_output(tmp_path):
    planted = {
        "WANDB_API_KEY": "planted-wandb-key-0123456789abcdef0123456789abcdef01234567",
        "HF_TOKEN": "planted-hf-token-9f8e7d6c",
        "AWS_SECRET_ACCESS_KEY": "planted-aws-secret-5a4b3c",
        "NCCL_TEST_AUTH_TOKEN": "planted-nccl-token-77aa",
    }
    git_secret = "planted-git-token-31d4"
    commit = _make_repo(tmp_path, f"https://bob:{git_secret}@example.com/lab/repo.git")
    run_dir = tmp_path / "run"
    args = [
        *QUICK,
        *WANDB,
        "--trainer.devices=2",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.log_every_n_steps=1",
        f"--run_dir={run_dir}",
        "--trainer.logger.init_args.upload_checkpoints=true",
        "--trainer.callbacks+=lightning_mlopt.callbacks.NCCLHealthCheck",
        "--trainer.callbacks.probe_mb=1",
    ]
    env = {**_wandb_env(tmp_path), **planted}
    # The first launch stops at step 3 with a committed, non-final checkpoint, as a preempted job would.
    first_only = ["--trainer.max_steps=3", "--checkpoint.every_n_steps=3", "--checkpoint.save_on.train_end=false"]
    first = run_cli([*args, *first_only], cwd=tmp_path, env=env, preloaded=True)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"WandbTracker: {run_dir}/wandb (offline" in first.stdout  # where the logs go, said at start
    (run,) = _offline_runs(run_dir)  # one W&B run for the 2-process job, not one per rank
    logged = summary_of(run)
    run_id = logged["id"]
    assert json.loads((run_dir / "wandb" / "run.json").read_text()) == {"run_id": run_id}  # recorded at creation
    # The full resolved config, once, from rank 0; provenance with the git state of the launch folder.
    assert str(logged["config"]["trainer"]["devices"]) == "2"
    assert logged["config"]["model"]["init_args"]["depth"] == 18
    provenance = logged["config"]["lightning_mlopt"]
    assert provenance["git"]["commit"] == commit and provenance["git"]["dirty"] is False
    assert provenance["lightning_mlopt"] == lightning_mlopt.__version__
    assert provenance["fingerprint"]["torch"] == torch.__version__
    assert [row["trainer/global_step"] for row in logged["history"] if "train/loss" in row] == [0, 1, 2]
    # The run id is in the committed checkpoint; the committed checkpoint is an artifact.
    manifest = CheckpointStore(run_dir / "checkpoints").newest_valid().manifest
    assert manifest.run_ids == {"wandb": run_id}
    (artifact,) = logged["artifacts"]
    assert artifact["name"] == f"checkpoint-{run_id}" and set(artifact["aliases"]) == {"latest", "step-3"}
    assert "state.ckpt" in artifact["files"]

    # A relaunch with more steps (a requeued job) resumes from the checkpoint and logs into the same run.
    second = run_cli([*args, "--trainer.max_steps=5"], cwd=tmp_path, env=env, preloaded=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Auto-resuming from" in second.stdout + second.stderr
    runs = _offline_runs(run_dir)
    assert len(runs) == 2 and {summary_of(r)["id"] for r in runs} == {run_id}
    resumed = summary_of(runs[1])
    assert [row["trainer/global_step"] for row in resumed["history"] if "train/loss" in row] == [3, 4]
    assert "final" in resumed["artifacts"][-1]["aliases"]

    # No planted secret anywhere: console, run directory, checkpoints, W&B files and staging, health logs.
    outputs = [first.stdout, first.stderr, second.stdout, second.stderr]
    for secret in [*planted.values(), git_secret]:
        assert all(secret not in text for text in outputs), secret
        leaks = [
            p
            for p in tmp_path.rglob("*")
            if p.is_file() and ".git" not in p.parts and secret.encode() in p.read_bytes()
        ]
        assert leaks == [], (secret, leaks)


@pytest.mark.parametrize("tracker", ["csv", "tensorboard"])
@pytest.mark.slow
def test_csv_and_tensorboard_trackers_write_into_the_run_directory(tracker, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    overlay = CONFIGS / "trackers" / f"{tracker}.yaml"
    main([*QUICK, "--config", str(overlay), *SMOKE, "--trainer.log_every_n_steps=1", "--run_dir=run"])
    out = capsys.readouterr().out
    folder = tmp_path / "run" / tracker / "version_0"
    assert f"logs         {'CSVLogger' if tracker == 'csv' else 'TensorBoardLogger'}: run/{tracker}/version_0" in out
    if tracker == "csv":
        header, *rows = (folder / "metrics.csv").read_text().splitlines()
        assert "train/loss" in header.split(",") and len(rows) >= 2
    else:
        assert list(folder.glob("events.out.tfevents.*"))
    assert (
        yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["trainer"]["logger"]["init_args"]["save_dir"]
        == "run"
    )  # "{run_dir}" was filled in
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["global_step"] == 2


# ---------------------------------------------------------------------- progress bar


def test_count_items_tells_tokens_from_samples():
    assert count_items((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))) == (64, "tokens")
    assert count_items([torch.zeros(8, 1, 8, 8), torch.zeros(8, dtype=torch.long)]) == (8, "samples")
    assert count_items({"x": torch.zeros(5, 3)}) == (5, "samples")
    assert count_items("no tensors") == (1, "samples")


def test_throughput_meter_rate_eta_and_pause():
    meter = ThroughputMeter(window=3)
    assert meter.rate() is None and meter.seconds_left(10) is None
    for now in (0.0, 0.5, 1.0, 1.5):
        meter.batch_done(items=100, now=now)
    assert meter.rate() == pytest.approx(200.0)
    assert meter.seconds_left(batches_left=10) == pytest.approx(5.0)
    assert meter.seconds_left(float("inf")) is None
    meter.pause()  # validation ran: its time is not a batch interval
    meter.batch_done(items=100, now=100.0)
    meter.batch_done(items=100, now=100.5)
    assert meter.rate() == pytest.approx(200.0)
    assert format_rate(1234.5) == "1.23k" and format_rate(2.5e6) == "2.50M" and format_rate(12.0) == "12.0"


@pytest.mark.slow
def test_the_cli_progress_bar_shows_throughput_and_eta(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = [*QUICK, "--trainer.max_steps=6", "--trainer.max_epochs=1", "--trainer.limit_val_batches=1"]
    main([*args, "--trainer.num_sanity_val_steps=0", "--run_dir=run"])
    captured = capsys.readouterr()
    bar = captured.out + captured.err
    assert "samples/s=" in bar and "eta=0:00:" in bar
    # stdout is not a terminal here (as in a SLURM log): plain lines, no redrawn bar.
    assert "\r" not in captured.out
    (line,) = [line for line in captured.out.splitlines() if line.startswith("step ")]
    assert line.startswith("step 6/6 (epoch 0): ") and "samples/s=" in line


@pytest.mark.slow
def test_progress_lines_come_every_n_steps_when_stdout_is_not_a_terminal(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = [*QUICK, "--trainer.max_steps=6", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0"]
    bar = [
        "--trainer.callbacks+=lightning_mlopt.tracking.ThroughputProgressBar",
        "--trainer.callbacks.log_every_n_steps=2",
    ]
    main([*args, *bar, "--run_dir=run"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"]


@pytest.mark.slow
def test_two_killed_launches_one_before_its_first_commit_end_as_one_wandb_run_with_every_row_once(tmp_path):
    # A SIGKILL to the job left W&B's offline file of that launch empty (its service buffers records): the
    # rows it logged were lost from `wandb sync`. The journal carries them into the next launch of the run, and
    # the run id recorded in the run directory keeps a launch killed before any checkpoint in the same run.
    import time

    run_dir = tmp_path / "run"
    pace = tmp_path / "pace"
    args = [
        "fit",
        "--model=tests.support.models.ThirdPartyLM",  # a user's model with its own dataloaders
        *WANDB,
        "--trainer.max_steps=16",
        "--trainer.max_epochs=-1",
        "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=1",
        "--checkpoint.every_n_steps=5",
        "--trainer.logger.init_args.upload_checkpoints=true",
        "--trainer.callbacks+=tests.support.faults.Pace",
        f"--trainer.callbacks.out_dir={pace}",
        "--trainer.callbacks.seconds_per_step=0.2",
        f"--run_dir={run_dir}",
    ]

    def kill_at(step: int) -> None:
        for stale in pace.glob("step-*"):  # each launch's own pace files
            stale.unlink()
        # Forked from the preloaded server: the subject is what W&B keeps, not how the job starts. The kill is of
        # the whole job (its process group: every rank and W&B's service), as a node loss delivers it.
        job = start_cli(args, tmp_path, _wandb_env(tmp_path), preloaded=True)
        deadline = time.monotonic() + 180
        while not (pace / f"step-{step}.rank0").exists() and time.monotonic() < deadline:
            assert job.poll() is None, f"the job ended before step {step}: {job.stderr_text()[-2000:]}"
            time.sleep(0.05)
        job.kill()
        job.wait(30)
        job.remove_outputs()

    kill_at(3)  # before the first commit (step 5): the next launch starts from scratch, in the same W&B run
    kill_at(8)  # resumes from step 5: steps 5..7 are trained (and logged) again
    third = run_cli(args, cwd=tmp_path, env=_wandb_env(tmp_path), preloaded=True)
    assert third.returncode == 0, third.stderr[-3000:]
    launches = _offline_runs(run_dir)
    assert len(launches) == 3 and len({folder.name.rsplit("-", 1)[1] for folder in launches}) == 1, launches
    steps = [row["trainer/global_step"] for row in summary_of(launches[-1])["history"] if "train_loss" in row]
    assert steps == list(range(16)), "every step once: 0..4 replayed from the journal, 5..15 trained"
    # The killed launch's checkpoint artifact (step 5) is logged again too, before this launch's own.
    aliases = [set(artifact["aliases"]) for artifact in summary_of(launches[-1])["artifacts"]]
    assert "step-5" in aliases[0] and "step-15" in aliases[-2] | aliases[-1]


@pytest.mark.slow
def test_wandb_logs_each_checkpoint_once_and_its_closing_lines_carry_no_colour_codes(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(
        [
            "fit",
            "--model=tests.support.models.ThirdPartyLM",
            *WANDB,
            "--trainer.max_steps=4",
            "--trainer.max_epochs=-1",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false",
            "--checkpoint.every_n_steps=2",  # step 4 is saved by every_n_steps, then again as the final save
            "--trainer.logger.init_args.upload_checkpoints=true",
            f"--run_dir={run_dir}",
        ],
        cwd=tmp_path,
        env={**_wandb_env(tmp_path), "WANDB_SILENT": "false"},  # W&B's own lines, as a user's log file has them
        preloaded=True,  # what W&B writes and says: imports paid once (the output is files, not a terminal)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = _offline_runs(run_dir)
    artifacts = summary_of(run)["artifacts"]
    assert [set(a["aliases"]) for a in artifacts] == [{"latest", "step-2"}, {"latest", "step-4", "final"}]
    output = result.stdout + result.stderr
    assert output.count("Adding directory to artifact") == 2, "one upload per checkpoint"
    assert "wandb sync" in output, "W&B's closing lines are there"
    assert "\x1b[" not in output, "an output that is not a terminal gets no ANSI colour codes"
