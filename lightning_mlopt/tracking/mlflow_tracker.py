"""MLflowTracker: MLflow logging for multi-process jobs that get killed, requeued, or lose their server."""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import re
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_mlopt.checkpoint.checksum import digest_of
from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, Manifest
from lightning_mlopt.hooks import CheckpointUploader, ResumeListener, RunTracker
from lightning_mlopt.redaction import redact
from lightning_mlopt.tracking.mlflow_run import MLflowRun, redacted_uri
from lightning_mlopt.tracking.mlflow_sender import MLflowSender
from lightning_mlopt.tracking.mlflow_settings import Delivery, refuse_flat_keys
from lightning_mlopt.tracking.outbox import Outbox
from lightning_mlopt.tracking.provenance import run_provenance
from lightning_mlopt.tracking.system_metrics import SystemMetricsSampler, node_name

if TYPE_CHECKING:
    from mlflow import MlflowClient

OUTBOX_FILE = "outbox.jsonl"
CHECKPOINT_RECORDS = "checkpoints"
"""The run's artifact folder of checkpoint records: ``step-<N>.json`` each (URL, step, manifest checksum)."""
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a parameter's value
# Keys of the CLI's config that say where or how this launch ran, not what the run is: never parameters.
_LAUNCH_KEYS = frozenset({"config", "ckpt_path", "print_config", "__path__", "run_dir"})
# What MLflow accepts in a metric, parameter or tag name; anything else becomes "_".
_UNSAFE_KEY = re.compile(r"[^\w\-./ ]")
# How long MLflow's own client retries one request (when the user set nothing): our sender retries forever, so
# one request should fail fast rather than hold the queue for minutes (its defaults: 7 retries, 120 s timeout).
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


class MLflowTracker(Logger, RunTracker, CheckpointUploader, ResumeListener):
    """MLflow logging that continues one run across relaunches and never lets the server stop training.

    A Lightning logger with the arguments of Lightning's ``MLFlowLogger`` (``experiment_name``, ``run_name``,
    ``tracking_uri``, ``tags``, ``save_dir``, ``prefix``, ``artifact_location``, ``run_id``) that fixes what
    breaks it on clusters:

    - **One run per run directory.** The run id is kept in ``<save_dir>/mlflow/run.json`` and in every
      FaultTolerantCheckpoint manifest (``run_ids.mlflow``); a relaunch or requeue logs into the same run, and
      ``MLFLOW_RUN_ID`` is exported so MLflow's autologging does too.
    - **Parameters once.** The resolved config (CLI) is logged as dotted parameters plus ``config.yaml`` as an
      artifact; a relaunch never logs a parameter the run has, so nothing that changed without changing the run
      (``ckpt_path``, a requeue's settings) raises ``INVALID_PARAMETER_VALUE``; a changed value is said once.
    - **Each step once, with the surviving value.** While FaultTolerantCheckpoint manages checkpoints, metric
      rows wait until a checkpoint after them commits (or the run finishes): the steps a killed launch ran
      after its last checkpoint are redone by the next launch, and only that computation reaches MLflow.
      Metrics therefore appear in MLflow at each checkpoint, not at each step (``delivery.hold_until_checkpoint``).
    - **Durable and asynchronous.** Everything logged is appended to ``<save_dir>/mlflow/outbox.jsonl`` first
      and sent by a background thread in batches. A server that is down is said once and retried; training
      goes on; the records are sent when it answers, at the end (up to ``delivery.flush_timeout_s``), or by the next
      launch of the run.
    - **System metrics** (CPU, memory, GPUs) every ``system_metrics_every_s`` under ``system/<node>/``.
    - **Checkpoints recorded, not copied**: each committed checkpoint gets ``checkpoints/step-<N>.json`` on the
      run (its URL, step, epoch and manifest SHA-256) and the tag ``mlopt.checkpoint.latest``.
    - Rank zero logs; secrets are redacted from everything sent.

    Args:
        experiment_name: the MLflow experiment (created when missing).
        run_name: display name of the run when it is created.
        tracking_uri: any MLflow tracking URI (``http://host:5000``, ``databricks``, ``postgresql://...``).
            None: ``MLFLOW_TRACKING_URI``, else a local SQLite store ``<save_dir>/mlflow/mlflow.db`` with
            artifacts in ``<save_dir>/mlflow/artifacts`` (view with ``mlflow ui --backend-store-uri ...``).
        tags: tags set on the run.
        save_dir: folder for this logger's files (``<save_dir>/mlflow``). In the CLI, ``"{run_dir}"``.
        prefix: put before every metric name (``prefix-name``), as Lightning's logger does.
        artifact_location: artifact root of an experiment this logger creates; None: the server's default.
        run_id: log into this run; None: the run this run directory logged to before, else a new one.
        checkpoint_dir: where FaultTolerantCheckpoint commits; None: ``<save_dir>/checkpoints``.
        system_metrics_every_s: seconds between system samples; None or 0: no system metrics.
        delivery: the sender's pace (``send_every_s``), the wait for the server at the end
            (``flush_timeout_s``), and whether step rows wait for a checkpoint (``hold_until_checkpoint``);
            see :class:`~lightning_mlopt.tracking.mlflow_settings.Delivery`.
        log_provenance: set git commit, dirty flag, command and our version as ``mlopt.*`` tags.

    Example::

        trainer = Trainer(logger=MLflowTracker(experiment_name="gpt", tracking_uri="http://127.0.0.1:5000",
                                               save_dir="runs/gpt"),
                          callbacks=[FaultTolerantCheckpoint(dirpath="runs/gpt/checkpoints")])

    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, Any] | None = None,
        save_dir: str = "./mlruns",
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
        checkpoint_dir: str | None = None,
        system_metrics_every_s: float | None = 10.0,
        delivery: Delivery = Delivery(),
        log_provenance: bool = True,
        **renamed: Any,
    ) -> None:
        super().__init__()
        refuse_flat_keys(renamed)
        if importlib.util.find_spec("mlflow") is None:
            raise ValueError("MLflowTracker needs the mlflow package: pip install 'lightning-mlopt[mlflow]'")
        if system_metrics_every_s is not None and system_metrics_every_s < 0:
            raise ValueError(f"system_metrics_every_s must be >= 0 or null, got {system_metrics_every_s}")
        if not experiment_name:
            raise ValueError("experiment_name must not be empty")
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.tags = dict(tags or {})
        self._save_dir = save_dir
        self._prefix = prefix
        self.artifact_location = artifact_location
        self.checkpoint_dir = checkpoint_dir
        self.system_metrics_every_s = system_metrics_every_s
        self.delivery = delivery
        self.log_provenance = log_provenance
        self._run = MLflowRun(
            self.folder, experiment_name, run_name, tracking_uri, artifact_location, run_id, checkpoint_dir
        )
        self._run.say = _say
        self._outbox: Outbox | None = None
        self._sender: MLflowSender | None = None
        self._sampler: SystemMetricsSampler | None = None
        self._connected = threading.Event()
        self._holds: bool | None = None  # None until decided: do step rows wait for checkpoints?
        self._recorded_steps: set[int] = set()
        self._system_step = 0

    # ------------------------------------------------------------------ Lightning's Logger surface

    @property
    @override
    def name(self) -> str:
        return self.experiment_name

    @property
    @override
    def version(self) -> str | None:
        return self.run_id

    @property
    @override
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def folder(self) -> Path:
        """The folder of this logger's own files: ``<save_dir>/mlflow``."""
        return Path(self._save_dir) / "mlflow"

    @property
    def run_id(self) -> str | None:
        """The MLflow run this run directory logs to (None until known: chosen, recorded, or created)."""
        return self._run.run_id

    def tracker_run_id(self) -> tuple[str, str] | None:
        """``("mlflow", run id)`` for a checkpoint manifest's ``run_ids``; None before the run exists."""
        return ("mlflow", self.run_id) if self.run_id else None

    @property
    @rank_zero_experiment
    def experiment(self) -> MlflowClient:
        """An ``MlflowClient`` for this logger's tracking URI (rank zero; others get a no-op object)."""
        self._start()
        return self._run.client()

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        outbox = self._start()
        if self._holds is None:  # nothing told us that checkpoints are managed: rows go as they come
            self._holds = False
            outbox.release_at_once()
        values = {}
        for key, value in metrics.items():
            name = f"{self._prefix}{self.LOGGER_JOIN_CHAR}{key}" if self._prefix else key
            values[_UNSAFE_KEY.sub("_", name)] = float(value)
        outbox.add("metrics", step=step, time_ms=_now_ms(), metrics=values)

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        params = params if isinstance(params, Mapping) else vars(params)
        self._log_params(redact(dict(params)))

    @rank_zero_only
    def log_run_config(self, config: dict[str, Any]) -> None:
        """The CLI's resolved config: dotted parameters (launch-specific keys left out) and ``config.yaml``."""
        import yaml

        config = redact(config)
        self._log_params({key: value for key, value in config.items() if key not in _LAUNCH_KEYS})
        text = yaml.safe_dump(_plain(config), sort_keys=False)
        self._start().add("text", path="config.yaml", text=text)

    @rank_zero_only
    def checkpoints_resumed(self, step: int, path: Path | None = None) -> None:
        """FaultTolerantCheckpoint manages this launch's checkpoints and it starts at ``step`` (from ``path``).

        From here, step rows wait for a committed checkpoint; what an earlier launch logged after ``step`` is
        dropped (this launch computes it again). The checkpoint resumed from is recorded if it was not.
        """
        outbox = self._start()
        if self.delivery.hold_until_checkpoint:
            self._holds = True
            outbox.resumed(step)
        if path is not None and (path / MANIFEST_NAME).is_file():
            self.log_checkpoint_artifact(path, Manifest.from_json((path / MANIFEST_NAME).read_bytes()))

    @rank_zero_only
    def log_checkpoint_artifact(self, path: Path, manifest: Manifest) -> None:
        """Record a committed checkpoint on the run (no bytes copied), and let the steps before it go."""
        outbox = self._start()
        if manifest.step not in self._recorded_steps:
            self._recorded_steps.add(manifest.step)
            manifest_file = path / MANIFEST_NAME
            record = {
                "url": path.resolve().as_uri() if path.exists() else str(path),
                "step": manifest.step,
                "epoch": manifest.epoch,
                "final": manifest.final,
                "reason": manifest.reason,
                "strategy": manifest.strategy,
                "manifest_sha256": digest_of(manifest_file, "sha256") if manifest_file.is_file() else None,
                "metric": manifest.metric,
                "created": manifest.created,
            }
            outbox.add("json", path=f"{CHECKPOINT_RECORDS}/step-{manifest.step}.json", value=record, key=manifest.step)
            outbox.add("tags", tags={"mlopt.checkpoint.latest": record["url"], "mlopt.checkpoint.step": manifest.step})
        if self._holds:
            outbox.release(manifest.step)
        outbox.sync()
        assert self._sender is not None
        self._sender.wake()

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._outbox is None:
            return
        succeeded = status == "success"
        if succeeded:
            self._outbox.release()  # every step of a finished launch survives
        self._outbox.add("status", status="FINISHED" if succeeded else "FAILED")
        self._stop(self.delivery.flush_timeout_s if succeeded else min(self.delivery.flush_timeout_s, 5.0))

    def describe_location(self) -> str:
        """Where this logger's records go, for the CLI's start-up summary."""
        where = redacted_uri(self._run.tracking_uri())
        return f"{where} (experiment {self.experiment_name!r}; outbox {self.folder})"

    # ------------------------------------------------------------------ the run and its records

    def _start(self) -> Outbox:
        """Once per launch, on rank zero: open the outbox, start the sender and the sampler, name the run."""
        if self._outbox is not None:
            if self._sender is None:  # finalized, then used again (e.g. `test` after `fit`)
                self._start_threads(self._outbox)
            return self._outbox
        for name, value in _HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        outbox = Outbox(self.folder / OUTBOX_FILE)
        self._outbox = outbox
        self._run.choose()
        self._recorded_steps = {int(step) for step in outbox.keys("json")}
        self._system_step = outbox.count("system")
        outbox.add("status", status="RUNNING")
        tags = {**self.tags, "mlopt.launch": outbox.launch, "mlopt.node": node_name()}
        if self.log_provenance:
            tags.update(_flatten({"mlopt": run_provenance()}))
            tags.pop("mlopt.fingerprint", None)
            tags = {key: value for key, value in tags.items() if not key.startswith("mlopt.fingerprint.")}
        tags = {key: str(value)[:MAX_PARAM_LENGTH] for key, value in redact(tags).items() if value is not None}
        outbox.add("tags", tags=tags)
        self._start_threads(outbox)
        # A moment for the server to name the run, so MLFLOW_RUN_ID is set before the model's own code runs;
        # a server that is down costs this wait once, then the run is created when it answers.
        self._connected.wait(timeout=5.0)
        atexit.register(self._stop, 5.0)
        return outbox

    def _start_threads(self, outbox: Outbox) -> None:
        self._sender = MLflowSender(
            outbox, self._connect, _say, self.delivery.send_every_s, redacted_uri(self._run.tracking_uri())
        )
        self._sender.start()
        if self.system_metrics_every_s:
            self._sampler = SystemMetricsSampler(self.system_metrics_every_s, self._record_system_sample)
            self._sampler.start()

    def _stop(self, timeout_s: float) -> None:
        """Stop sampling; give the sender up to ``timeout_s`` to send what survives; say what is left."""
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        sender, self._sender = self._sender, None
        if sender is None or self._outbox is None:
            return
        if not sender.flush(timeout_s):  # rows still held for a checkpoint are not "unsent": the relaunch decides
            _say(
                f"MLflow: {len(self._outbox.sendable())} record(s) not sent yet; they are kept in "
                f"{self._outbox.path} and the next launch of this run sends them"
            )
        sender.stop()
        self._outbox.sync()

    def _connect(self) -> tuple[MlflowClient, str]:
        """The sender's way in: the client and the run, created on the first call that reaches the server."""
        client, run_id = self._run.connect()
        if not self._connected.is_set():
            os.environ["MLFLOW_RUN_ID"] = run_id  # MLflow's fluent API and autologging join this run
            self._connected.set()
        return client, run_id

    def _record_system_sample(self, values: dict[str, float]) -> None:
        assert self._outbox is not None
        node = node_name()
        named = {f"system/{node}/{key}": value for key, value in values.items()}
        self._outbox.add("system", step=self._system_step, time_ms=_now_ms(), metrics=named)
        self._system_step += 1

    def _log_params(self, params: Mapping[str, Any]) -> None:
        flat = {_UNSAFE_KEY.sub("_", key): str(value)[:MAX_PARAM_LENGTH] for key, value in _flatten(params).items()}
        if flat:
            self._start().add("params", params=flat)


def _flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and other values stay whole (JSON for lists and dicts)."""
    flat: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, Mapping) and item:
            flat.update(_flatten(item, f"{name}."))
        elif isinstance(item, (list, tuple, Mapping)):
            flat[name] = json.dumps(_plain(item), default=str)
        else:
            flat[name] = item
    return flat


def _plain(value: Any) -> Any:
    """Plain dicts, lists and scalars (for YAML and JSON); anything else as its string."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
