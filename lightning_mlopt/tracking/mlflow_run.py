"""Which MLflow run a run directory logs to, across every launch: chosen once, created on first contact, recorded.

The order: an explicit ``run_id``; the one in ``<folder>/run.json`` (written when the run was created, for the
same tracking URI); the one the newest committed checkpoint records (``run_ids.mlflow``: a run directory whose
``mlflow`` folder was lost); ``MLFLOW_RUN_ID`` (set by the user, or a launcher); else a new run, created when the
server first answers, so a server that is down at start costs no training time.

Example::

    run = MLflowRun(Path("runs/x/mlflow"), "gpt", None, "http://127.0.0.1:5000", None, None, None)
    run.choose()                  # the recorded run, if any (no request)
    client, run_id = run.connect()  # creates it on the server if needed, and records it
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_mlopt.checkpoint.manifest import write_atomically
from lightning_mlopt.checkpoint.store import CheckpointStore
from lightning_mlopt.redaction import redact
from lightning_mlopt.run_dir import CHECKPOINTS_DIR

if TYPE_CHECKING:
    from mlflow import MlflowClient

RUN_FILE = "run.json"


class MLflowRun:
    """The MLflow run of one run directory.

    Args:
        folder: the tracker's folder (``<save_dir>/mlflow``): ``run.json`` and the default local store live here.
        experiment_name: the experiment a new run goes into (created when missing).
        run_name: display name of a new run.
        tracking_uri: the tracking URI; None: ``MLFLOW_TRACKING_URI``, else ``sqlite:///<folder>/mlflow.db``.
        artifact_location: artifact root of an experiment created here; None: the server's (the local store:
            ``<folder>/artifacts``).
        run_id: a fixed run; None: chosen as the module says.
        checkpoint_dir: where FaultTolerantCheckpoint commits; None: ``<folder>/../checkpoints``.

    """

    def __init__(
        self,
        folder: Path,
        experiment_name: str,
        run_name: str | None,
        tracking_uri: str | None,
        artifact_location: str | None,
        run_id: str | None,
        checkpoint_dir: str | None,
    ) -> None:
        self.folder = folder
        self.experiment_name = experiment_name
        self.run_name = run_name
        self._tracking_uri = tracking_uri
        self.artifact_location = artifact_location
        self.run_id = run_id
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else folder.parent / CHECKPOINTS_DIR
        self.say: Callable[[str], None] = print
        self._client: MlflowClient | None = None
        self._checked = False  # whether the run was found on (or created in) the server

    def tracking_uri(self) -> str:
        """The tracking URI in use: the argument, else ``MLFLOW_TRACKING_URI``, else the local SQLite store."""
        if self._tracking_uri:
            return self._tracking_uri
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        return f"sqlite:///{(self.folder / 'mlflow.db').resolve()}"

    def is_local_store(self) -> bool:
        """Whether the run lives in the default local SQLite store in ``folder``."""
        return not (self._tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))

    def choose(self) -> str | None:
        """Settle on the recorded run, if there is one (reads files only); None: a new run, on first contact."""
        self.run_id = self.run_id or self._recorded()
        return self.run_id

    def client(self) -> MlflowClient:
        """An ``MlflowClient`` for the tracking URI (made once)."""
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri())
        return self._client

    def connect(self) -> tuple[MlflowClient, str]:
        """The client and the run id; creates the run (and its experiment) on the server when there is none yet."""
        client = self.client()
        if self.run_id is not None and not self._checked and not _exists(client, self.run_id):
            self.say(f"MLflow: run {self.run_id} is not on {redacted_uri(self.tracking_uri())}; starting a new run")
            self.run_id = None
        if self.run_id is None:
            self.run_id = self._create(client)
            self._record()
        elif not (self.folder / RUN_FILE).is_file():
            self._record()
        self._checked = True
        return client, self.run_id

    def _create(self, client: MlflowClient) -> str:
        experiment = client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            location = self.artifact_location
            if location is None and self.is_local_store():
                location = (self.folder / "artifacts").resolve().as_uri()  # beside the store, not in the cwd
            experiment_id = client.create_experiment(self.experiment_name, artifact_location=location)
        return str(client.create_run(experiment_id, run_name=self.run_name).info.run_id)

    def _recorded(self) -> str | None:
        try:
            recorded = json.loads((self.folder / RUN_FILE).read_text())
        except (OSError, ValueError):
            # No run.json (a run directory whose mlflow folder was lost): the checkpoints still name the run.
            return CheckpointStore(self.checkpoint_dir).recorded_run_id("mlflow") or os.environ.get("MLFLOW_RUN_ID")
        if recorded.get("tracking_uri") != redacted_uri(self.tracking_uri()):
            return None  # this run directory now logs to another server: a new run there
        run_id = recorded.get("run_id")
        return str(run_id) if run_id else None

    def _record(self) -> None:
        """Write ``run.json`` atomically (a kill mid-write leaves the previous one or none, never half of one)."""
        assert self.run_id is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        content = {
            "run_id": self.run_id,
            "experiment_name": self.experiment_name,
            "tracking_uri": redacted_uri(self.tracking_uri()),
        }
        write_atomically(self.folder / RUN_FILE, json.dumps(content, indent=2))


def _exists(client: MlflowClient, run_id: str) -> bool:
    """Whether the server has ``run_id``: False only when it says so; any other failure raises (down)."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    return True


def redacted_uri(uri: str) -> str:
    """``uri`` without credentials (``https://user:token@host`` -> ``https://<redacted>@host``)."""
    return str(redact(uri))
