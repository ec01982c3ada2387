"""WandbTracker: Lightning's WandbLogger, made safe for multi-process jobs that get killed and relaunched."""

from __future__ import annotations

import atexit
import json
import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lightning_mlopt._compat import wandb_init_kwargs, wandb_requested_id, wandb_run_if_started
from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, Manifest
from lightning_mlopt.checkpoint.store import CheckpointStore
from lightning_mlopt.exceptions import first_line
from lightning_mlopt.hooks import CheckpointUploader, RunTracker
from lightning_mlopt.process import exit_codes, launch_report
from lightning_mlopt.redaction import redact
from lightning_mlopt.run_dir import CHECKPOINTS_DIR
from lightning_mlopt.tracking.journal import Journal
from lightning_mlopt.tracking.provenance import run_provenance

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

Mode = Literal["auto", "online", "offline", "disabled"]

RUN_FILE = "run.json"
"""``<save_dir>/wandb/run.json``: the W&B run this save folder logs to, written when the run is created."""


class WandbTracker(WandbLogger, RunTracker, CheckpointUploader):
    """Weights & Biases logging that works without a network and continues one run across relaunches.

    On top of Lightning's ``WandbLogger`` (rank zero logs; other ranks get a no-op experiment):

    - ``mode: auto`` (the default) is online when an API key is configured (``WANDB_API_KEY`` or
      ``wandb login``) and offline otherwise, so a run never fails for lack of network; ``WANDB_MODE`` wins.
      Offline runs are synced later with ``wandb sync <save_dir>/wandb/offline-run-*``.
    - One W&B run per job, continued across relaunches: the run id is the explicit ``id``, else the one a
      W&B sweep agent set (``WANDB_RUN_ID``), else the one recorded in ``<save_dir>/wandb/run.json`` when the
      run was created (so a launch killed before its first checkpoint, or one whose checkpoints live in another
      ``checkpoint.dirpath``, is continued too), else the one the newest committed FaultTolerantCheckpoint
      under ``checkpoint_dir`` records. The save folder is the run's identity: the CLI gives each run its own
      run directory, so unrelated runs launched from one folder stay apart.
    - Provenance logged once per job under the config key ``lightning_mlopt``: our version, git commit,
      dirty flag and origin URL (without credentials), the command, the environment fingerprint.
    - The CLI sends the full resolved config through :meth:`log_run_config`.
    - Secrets (secret-named environment variables, URL credentials) are redacted from everything this
      logger sends; W&B's own git capture is off, since it records the remote URL as written.
    - ``upload_checkpoints``: each checkpoint FaultTolerantCheckpoint commits is logged as a ``model``
      artifact ``checkpoint-<run id>`` with aliases ``latest``, ``step-<N>`` (and ``final``), once: a folder
      committed again (the last periodic save, re-saved as final) is logged as its newer manifest only. Costs
      one copy of the checkpoint into W&B's staging folder on rank zero per save; offline runs upload on sync.
    - The run is finished by this logger as the process ends (W&B would, but its own closing lines write raw
      ANSI colour codes into log files), and after a successful run whose process leaves without exit hooks.

    Args:
        project: W&B project (``WANDB_PROJECT`` when unset).
        name: display name of the run; None: W&B picks one.
        save_dir: folder for W&B's files (``<save_dir>/wandb``). In the CLI, ``"{run_dir}"`` is the run
            directory.
        id: a fixed run id; None: chosen as described above.
        mode: ``auto``, ``online``, ``offline`` or ``disabled``.
        entity: W&B entity (user or team); None: the account's default.
        group: group runs together, e.g. the trials of a sweep.
        tags: tags for the run.
        checkpoint_dir: where FaultTolerantCheckpoint commits; None: ``<save_dir>/checkpoints`` (its default
            in the CLI's run directory).
        upload_checkpoints: log committed checkpoints as W&B artifacts.
        log_provenance: log git state, command and environment fingerprint once per job.

    Example::

        trainer = Trainer(logger=WandbTracker(project="gpt", save_dir="runs/gpt"),
                          callbacks=[FaultTolerantCheckpoint(dirpath="runs/gpt/checkpoints")])

    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        save_dir: str = ".",
        id: str | None = None,
        mode: Mode = "auto",
        entity: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        checkpoint_dir: str | None = None,
        upload_checkpoints: bool = False,
        log_provenance: bool = True,
    ) -> None:
        if mode not in ("auto", "online", "offline", "disabled"):
            raise ValueError(f"mode must be one of auto, online, offline, disabled; got {mode!r}")
        super().__init__(name=name, save_dir=save_dir, id=id, project=project, entity=entity, group=group, tags=tags)
        wandb_init_kwargs(self).pop("anonymous", None)  # deprecated in wandb; passing it (even None) warns
        self.mode = mode
        self.checkpoint_dir = checkpoint_dir
        self.upload_checkpoints = upload_checkpoints
        self.log_provenance = log_provenance
        self._journal: Journal | None = None
        self._replayed = False
        # The newest committed folder, logged when the next one comes, at the next row or at the end: the
        # final save of a step already saved replaces it, so that checkpoint is one artifact, not two.
        self._pending_artifact: tuple[Path, Manifest] | None = None
        self._finished = False

    def resolved_mode(self) -> str:
        """The mode a run created now would use (``auto`` resolved)."""
        if self.mode != "auto":
            return self.mode
        return os.environ.get("WANDB_MODE") or ("online" if _api_key_configured() else "offline")

    @property
    @rank_zero_experiment
    @override
    def experiment(self) -> Run:
        if wandb_run_if_started(self) is None:
            import wandb

            run_id = self._choose_run_id()
            mode = self.resolved_mode()
            wandb_init_kwargs(self).update(
                mode=mode,
                id=run_id,
                settings=wandb.Settings(disable_git=True),  # we record git ourselves, without credentials
            )
            try:
                run = WandbLogger.experiment.fget(self)  # type: ignore[attr-defined]
            except wandb.errors.Error as error:
                # Credentials on a shared home, no route to the server from this node: `auto` means a run never
                # fails for lack of network (an explicit `online` is the user's demand, and fails).
                if mode != "online" or self.mode != "auto" or os.environ.get("WANDB_MODE"):
                    raise
                rank_zero_warn(
                    f"W&B could not be reached ({first_line(error)}); logging offline instead: "
                    f"{self._offline_location()}"
                )
                wandb_init_kwargs(self)["mode"] = "offline"
                run = WandbLogger.experiment.fget(self)  # type: ignore[attr-defined]
            if self.log_provenance:
                run.config.update({"lightning_mlopt": run_provenance()}, allow_val_change=True)
            record_run_id(self._wandb_folder(), str(run.id))
            self._open_journal(run)
            # After the journal's exit hook: LIFO, so the run finishes first, then the journal closes.
            atexit.register(self._finish)
            launch_report.on_exit(self._finish_after_success)
        run = wandb_run_if_started(self)
        assert run is not None  # started above
        return run

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        _ = self.experiment  # creates the run, which opens the journal
        self._replay_lost(before_step=step)
        self._log_pending_artifact()
        if self._journal is not None:
            self._journal.record(metrics, step)
        super().log_metrics(metrics, step)

    def _replay_lost(self, before_step: int | None) -> None:
        """Once, before this launch logs anything: log what launches that never closed had logged.

        Rows before ``before_step``, and the checkpoint artifacts whose folders still exist.
        """
        if self._journal is None or self._replayed:
            return
        self._replayed = True
        rows, artifacts = self._journal.unsynced(before_step=before_step)
        for row in rows:
            self.experiment.log(row)
        for folder in artifacts:
            manifest_file = folder / MANIFEST_NAME
            if manifest_file.is_file():  # retention may have removed it since
                self.log_checkpoint_artifact(folder, Manifest.from_json(manifest_file.read_bytes()))

    def _open_journal(self, run: Run) -> None:
        """Journal every row this launch logs (``<save_dir>/wandb/journal-<run id>.jsonl``), closed at exit."""
        segment = Path(run.dir).parent.name if getattr(run, "dir", None) else "segment"
        self._journal = Journal(Path(self.save_dir or ".") / "wandb" / f"journal-{run.id}.jsonl", segment)
        journal = self._journal
        # After wandb's own exit hook is registered (at init), so this runs first: LIFO. A SIGKILL runs neither.
        atexit.register(lambda: journal.close("exit"))

    def tracker_run_id(self) -> tuple[str, str] | None:
        """``("wandb", run id)`` for a checkpoint manifest's ``run_ids``; None before the run exists."""
        return ("wandb", str(self.version)) if self.version else None

    @rank_zero_only
    def log_run_config(self, config: dict[str, Any]) -> None:
        """Log a run's full resolved configuration (secrets redacted) into the W&B config, rank zero."""
        self.experiment.config.update(redact(config), allow_val_change=True)

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        super().log_hyperparams(redact(params) if isinstance(params, dict) else params)

    @rank_zero_only
    def log_checkpoint_artifact(self, path: Path, manifest: Manifest) -> None:
        """Log a committed checkpoint folder as an artifact, when ``upload_checkpoints`` is on (rank zero).

        It is logged when the next folder, the next row or the end of the run comes (see ``__init__``); the
        journal has it at once, so a launch killed before then leaves it to the next one.
        """
        if not self.upload_checkpoints or not path.is_dir():
            return
        _ = self.experiment  # creates the run, which opens the journal
        self._replay_lost(before_step=manifest.step)
        if self._pending_artifact is not None and self._pending_artifact[0] != path:
            self._log_pending_artifact()
        if self._journal is not None and self._pending_artifact is None:
            self._journal.record_artifact(path)
        self._pending_artifact = (path, manifest)

    def _log_pending_artifact(self) -> None:
        if self._pending_artifact is None:
            return
        import wandb

        path, manifest = self._pending_artifact
        self._pending_artifact = None
        if not path.is_dir():
            return  # retention removed it since
        run = self.experiment
        metadata = {"step": manifest.step, "epoch": manifest.epoch, "strategy": manifest.strategy}
        if manifest.metric:
            metadata.update(manifest.metric)
        artifact = wandb.Artifact(f"checkpoint-{run.id}", type="model", metadata=metadata)
        artifact.add_dir(str(path))
        aliases = ["latest", f"step-{manifest.step}", *(["final"] if manifest.final else [])]
        run.log_artifact(artifact, aliases=aliases)

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._log_pending_artifact()
        super().finalize(status)

    def _finish(self, exit_code: int | None = None) -> None:
        """Log what is pending and finish the run (``exit_code`` None: the one W&B's exit hooks saw)."""
        run = wandb_run_if_started(self)
        if run is None or self._finished:
            return
        self._finished = True
        self._log_pending_artifact()
        run.finish(exit_code=exit_code)
        if self._journal is not None:
            self._journal.close("finished")

    def _finish_after_success(self, status: int) -> None:
        # Only a success: finishing waits for W&B's uploads, which must not eat into a preemption's grace. A
        # failed or preempted process finishes at interpreter exit (_finish, registered with atexit), where W&B
        # itself would, or not at all when it leaves without exit hooks (the journal covers that).
        if status == exit_codes.SUCCESS:
            self._finish(exit_code=0)

    def describe_location(self) -> str:
        """Where this logger's files go and how to see them, for the CLI's start-up summary."""
        mode = self.resolved_mode()
        if mode == "offline":
            return self._offline_location()
        return f"{Path(self.save_dir or '.') / 'wandb'} ({mode})"

    def _offline_location(self) -> str:
        where = Path(self.save_dir or ".") / "wandb"
        return f"{where} (offline; upload later with `wandb sync {where}/offline-run-*`)"

    def _wandb_folder(self) -> Path:
        return Path(self.save_dir or ".") / "wandb"

    def _choose_run_id(self) -> str | None:
        if wandb_requested_id(self):
            return wandb_requested_id(self)
        if os.environ.get("WANDB_RUN_ID"):
            return None  # a W&B sweep agent (or the user) chose it; wandb.init reads it
        recorded = recorded_run_id(self._wandb_folder())
        if recorded is not None:
            return recorded
        root = Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.save_dir or ".") / CHECKPOINTS_DIR
        return CheckpointStore(root).recorded_run_id("wandb")


def record_run_id(folder: Path, run_id: str) -> None:
    """Write ``folder/run.json`` naming ``run_id``, atomically (a kill mid-write leaves the old record or none).

    Example::

        record_run_id(Path("runs/gpt/wandb"), "3kx9q2ab")
        recorded_run_id(Path("runs/gpt/wandb"))   # "3kx9q2ab"
    """
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f".{RUN_FILE}.{os.getpid()}"
    staging.write_text(json.dumps({"run_id": run_id}) + "\n")
    os.replace(staging, folder / RUN_FILE)


def recorded_run_id(folder: Path) -> str | None:
    """The run id ``folder/run.json`` names; None when there is none or it cannot be read."""
    try:
        run_id = json.loads((folder / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return str(run_id) if run_id else None


def _api_key_configured() -> bool:
    """Whether W&B has credentials here: ``WANDB_API_KEY``, or a netrc entry from ``wandb login``."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False
