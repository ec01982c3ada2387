"""The background thread that takes an outbox's records to an MLflow tracking server, whatever the server does.

Training never waits for MLflow: the tracker appends to the outbox (``outbox.py``) and this thread sends what
survives, in batches of up to 1000 values (one ``log_batch`` request each, as MLflow's own async logging does).
A server that does not answer is said once, retried with a growing pause (up to 30 s), and said again when it
answers; nothing waiting is lost meanwhile, since it is on disk. A request the server refuses (a 4xx: a bad
key, a deleted run) is said and its records dropped: sending them again would fail the same way.

Parameters are checked against the run's own before they are sent: MLflow refuses a parameter logged again
with another value (``INVALID_PARAMETER_VALUE``), so a relaunch never sends one it has, and names the ones it
kept with the first value.

Example::

    sender = MLflowSender(outbox, connect=lambda: (client, run_id), say=print, every_s=2.0)
    sender.start()
    ...
    sender.flush(timeout_s=30.0)   # True once everything that survives is on the server
    sender.stop()
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_mlopt.tracking.outbox import Outbox

if TYPE_CHECKING:
    from mlflow import MlflowClient

MAX_BATCH = 1000  # MLflow's log_batch limit: 1000 metrics, 100 params, 100 tags per request
_MAX_PARAMS, _MAX_TAGS = 100, 100
_LONGEST_PAUSE_S = 30.0

Connect = Callable[[], "tuple[MlflowClient, str]"]


class MLflowSender:
    """Sends an outbox's surviving records to MLflow from a daemon thread; retries while the server is down.

    Args:
        outbox: the records to send.
        connect: returns the client and the run id, creating the run when needed; may raise (server down).
        say: how to tell the user (one line each; rank zero's stderr in the tracker).
        every_s: seconds between passes while all is well.
        where: the tracking URI, for messages.

    """

    def __init__(self, outbox: Outbox, connect: Connect, say: Callable[[str], None], every_s: float, where: str):
        self.outbox = outbox
        self.connect = connect
        self.say = say
        self.every_s = every_s
        self.where = where
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._idle = threading.Condition()
        self._passes = 0
        self._down_since: float | None = None
        self._server_params: dict[str, str] | None = None  # the run's parameters, read once per connection
        self._kept_first: set[str] = set()
        self._thread = threading.Thread(target=self._loop, name="mlopt-mlflow-sender", daemon=True)

    def start(self) -> None:
        """Start sending in the background."""
        self._thread.start()

    def wake(self) -> None:
        """Make a pass now instead of at the next interval."""
        self._wake.set()

    @property
    def is_down(self) -> bool:
        """Whether the last pass failed to reach the server."""
        return self._down_since is not None

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a pass that leaves nothing sendable; whether that happened."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            seen = self._passes
            while self._thread.is_alive():
                self._wake.set()
                if self._passes > seen and not self.is_down and not self.outbox.sendable():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.5))
        return not self.outbox.sendable()

    def stop(self) -> None:
        """End the thread after its current request (records not sent stay in the outbox)."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=_LONGEST_PAUSE_S)

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        pause = self.every_s
        while not self._stopping.is_set():
            try:
                self._send_pass()
            except Exception as error:  # the server or the network: wait and try again, never end training
                self._went_down(error)
                pause = min(max(pause, self.every_s) * 2, _LONGEST_PAUSE_S)
            else:
                self._came_back()
                pause = self.every_s
            with self._idle:
                self._passes += 1
                self._idle.notify_all()
            self._wake.wait(pause)
            self._wake.clear()

    def _send_pass(self) -> None:
        dropped = self.outbox.dropped()
        self.outbox.mark_done(dropped)  # a later launch computed these steps again
        records = self.outbox.sendable()
        if not records:
            return
        client, run_id = self.connect()
        if self._server_params is None:
            self._server_params = dict(client.get_run(run_id).data.params)
        batch: list[dict[str, Any]] = []
        for record in records:
            if record["kind"] in ("metrics", "system", "params", "tags"):
                batch.append(record)
                if _batch_is_full(batch):
                    self._send_batch(client, run_id, batch)
                    batch = []
                continue
            self._send_batch(client, run_id, batch)
            batch = []
            self._send_one(client, run_id, record)
        self._send_batch(client, run_id, batch)

    def _send_batch(self, client: MlflowClient, run_id: str, batch: list[dict[str, Any]]) -> None:
        """Metrics, parameters and tags of ``batch`` in as few ``log_batch`` requests as MLflow's limits allow."""
        if not batch:
            return
        from mlflow.entities import Metric, Param, RunTag

        metrics = [
            Metric(key, float(value), int(record["time_ms"]), int(record.get("step") or 0))
            for record in batch
            if record["kind"] in ("metrics", "system")
            for key, value in record["metrics"].items()
        ]
        params = [Param(key, value) for key, value in self._new_params(batch).items()]
        tags = [
            RunTag(key, str(value))
            for record in batch
            if record["kind"] == "tags"
            for key, value in record["tags"].items()
        ]
        assert self._server_params is not None
        while metrics or params or tags:
            some_params, params = params[:_MAX_PARAMS], params[_MAX_PARAMS:]
            some_tags, tags = tags[:_MAX_TAGS], tags[_MAX_TAGS:]
            room = MAX_BATCH - len(some_params) - len(some_tags)
            some_metrics, metrics = metrics[:room], metrics[room:]
            request = functools.partial(
                client.log_batch, run_id, some_metrics, some_params, some_tags, synchronous=True
            )
            done = self._refusable(request, "values")
            if done:  # a refused request's parameters are not the run's either
                self._server_params.update({param.key: param.value for param in some_params})
        self.outbox.mark_done(record["i"] for record in batch)

    def _new_params(self, batch: list[dict[str, Any]]) -> dict[str, str]:
        """The batch's parameters the run does not have yet; a changed value is kept as first logged, and said."""
        assert self._server_params is not None
        new: dict[str, str] = {}
        changed = []
        for record in batch:
            for key, value in record.get("params", {}).items() if record["kind"] == "params" else ():
                known = self._server_params.get(key, new.get(key))
                if known is None:
                    new[key] = value
                elif known != value and key not in self._kept_first:
                    changed.append(key)
        if changed:
            self._kept_first.update(changed)
            self.say(
                f"MLflow: {len(changed)} parameter(s) differ from what this run logged first and keep their first "
                f"value (MLflow cannot change a parameter): {', '.join(sorted(changed)[:5])}"
                f"{' ...' if len(changed) > 5 else ''}"
            )
        return new

    def _send_one(self, client: MlflowClient, run_id: str, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == "text":
            action: Callable[[], Any] = lambda: client.log_text(run_id, record["text"], record["path"])  # noqa: E731
        elif kind == "json":
            action = lambda: client.log_dict(run_id, record["value"], record["path"])  # noqa: E731
        elif kind == "status":
            action = lambda: client.update_run(run_id, status=record["status"])  # noqa: E731
        else:
            self.say(f"MLflow: skipped a record of unknown kind {kind!r} (written by a newer version?)")
            self.outbox.mark_done([record["i"]])
            return
        self._refusable(action, kind)
        self.outbox.mark_done([record["i"]])

    def _refusable(self, action: Callable[[], Any], what: str) -> bool:
        """Run one request: True when it succeeded, False when the server refused it for good (said)."""
        try:
            action()
        except Exception as error:
            if not _refused(error):
                raise  # down or unreachable: retried by the loop, the records stay
            self.say(f"MLflow: {self.where} refused a request ({what}), its records dropped: {_short(error)}")
            return False
        return True

    def _went_down(self, error: Exception) -> None:
        self._server_params = None  # read again after reconnecting: another launch may have logged meanwhile
        if self._down_since is None:
            self._down_since = time.monotonic()
            self.say(
                f"MLflow: cannot reach {self.where} ({_short(error)}); training goes on, the records wait in "
                f"{self.outbox.path} and are sent when it answers"
            )

    def _came_back(self) -> None:
        if self._down_since is not None:
            waited = time.monotonic() - self._down_since
            self._down_since = None
            self.say(f"MLflow: {self.where} answers again after {waited:.0f} s; the waiting records are sent")


def _batch_is_full(batch: list[dict[str, Any]]) -> bool:
    """Enough for a few requests: the records are marked done together once all of theirs went."""
    sizes = (len(record.get("metrics") or record.get("params") or record.get("tags") or ()) for record in batch)
    return sum(sizes) >= MAX_BATCH


def _refused(error: Exception) -> bool:
    """A request the server answered with a 4xx other than 429: sending it again fails the same way."""
    status = getattr(error, "get_http_status_code", lambda: None)()
    return isinstance(status, int) and 400 <= status < 500 and status != 429


_CAUSES = (
    ("Connection refused", "connection refused"),
    ("timed out", "timed out"),
    ("Name or service not known", "unknown host"),
    ("nodename nor servname", "unknown host"),
    ("Connection reset", "connection reset"),
)


def _short(error: Exception) -> str:
    """The cause in a few words: a network failure by its name, anything else by its first 160 characters."""
    text = " ".join(str(error).split())
    for marker, cause in _CAUSES:
        if marker in text:
            return cause
    return f"{type(error).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"
