"""Cloud preemption notices: a spot VM is taken away with a notice in its metadata server, not a signal.

AWS posts ``/latest/meta-data/spot/instance-action`` (``{"action": "terminate", "time": "...Z"}``) about two
minutes before it reclaims a spot instance, readable with an IMDSv2 session token. GCE sets
``instance/preempted`` to ``TRUE`` when it preempts a spot VM (30 s before it stops it) and
``instance/maintenance-event`` to ``TERMINATE_ON_HOST_MAINTENANCE`` ahead of a host maintenance that stops it
(60 s). A background thread polls the endpoints every few seconds and raises the same flag a SIGTERM raises,
with the notice's deadline as the grace (:meth:`PreemptionSignals.notify`).

The endpoints are where the clouds' own SDKs look: ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (default
``http://169.254.169.254``) and ``GCE_METADATA_HOST`` (default ``metadata.google.internal``), which is also how a
test points the poller at a server on loopback. ``auto`` polls a provider only on a VM of that cloud (its DMI
vendor says so, or its endpoint variable is set), so a laptop or an on-premises cluster polls nothing; polling
runs on its own thread and never delays start-up.

Standard library only.

Example::

    from lightning_mlopt.process.notices import NoticePoller
    from lightning_mlopt.process.signals import preemption

    NoticePoller(["aws", "gce"], preemption.notify).start()   # or providers_for("auto")
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PROVIDERS = ("aws", "gce")
AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
GCE_HOST_ENV = "GCE_METADATA_HOST"
GCE_PREEMPTION_S = 30.0  # GCE stops a preempted spot VM 30 s after setting `preempted`
GCE_MAINTENANCE_S = 60.0  # and announces a terminating host maintenance 60 s ahead
_DMI = Path("/sys/class/dmi/id")
NOTICES_BY_LAUNCHER_ENV = "LIGHTNING_MLOPT_NOTICES_BY_LAUNCHER"
"""Set for the workers of a ``launch``, which polls the notices itself (once per node, not once per rank)."""

OnNotice = Callable[[str, float], None]
"""Called once with what the notice says (``"an AWS spot notice (terminate)"``) and the seconds it leaves."""


@dataclass
class PreemptionNotices:
    """The ``preemption:`` section of a run's YAML: which cloud notices count as a preemption signal.

    Args:
        notices: ``auto`` (the clouds this VM belongs to; none off the cloud), ``off``, or a list of ``aws``,
            ``gce``. Under ``launch`` the launcher polls them (once per node) and forwards a SIGTERM.
        poll_interval_s: seconds between two polls of each endpoint.

    Example (YAML)::

        preemption:
          notices: [aws]
          poll_interval_s: 5

    """

    notices: list[str] | str = field(default="auto")
    poll_interval_s: float = 5.0

    def __post_init__(self) -> None:
        providers_for(self.notices)  # a bad name fails here, when the config is read
        if self.poll_interval_s <= 0:
            raise ValueError(f"preemption.poll_interval_s must be > 0, got {self.poll_interval_s}")


def providers_for(notices: Iterable[str] | str, env: Mapping[str, str] | None = None) -> list[str]:
    """The providers to poll for ``notices`` (``auto``, ``off``, ``none`` or names); ValueError names a bad one."""
    env = os.environ if env is None else env
    if isinstance(notices, str):
        if notices in ("off", "none", ""):
            return []
        if notices == "auto":
            return [name for name in PROVIDERS if _on_cloud(name, env)]
        notices = [part.strip() for part in notices.split(",")]
    names = list(notices)
    unknown = [name for name in names if name not in PROVIDERS]
    if unknown:
        raise ValueError(f"preemption.notices: unknown provider(s) {unknown}; use auto, off, or some of {PROVIDERS}")
    return names


def _on_cloud(provider: str, env: Mapping[str, str]) -> bool:
    """Whether this VM belongs to ``provider``'s cloud: its endpoint variable is set, or its DMI vendor says so."""
    if provider == "aws":
        return AWS_ENDPOINT_ENV in env or "Amazon EC2" in _dmi("sys_vendor") + _dmi("board_vendor")
    return GCE_HOST_ENV in env or "Google" in _dmi("product_name")


def _dmi(name: str) -> str:
    try:
        return (_DMI / name).read_text()
    except OSError:
        return ""


class NoticePoller:
    """Poll the providers' metadata endpoints on a daemon thread; call ``on_notice`` at the first notice.

    Args:
        providers: ``aws`` and/or ``gce``.
        on_notice: what a notice does, e.g. :meth:`PreemptionSignals.notify`.
        interval_s: seconds between polls.
        timeout_s: how long one request may take (an endpoint that does not answer costs this, on this thread).
        env: where the endpoint variables are read (default: the process environment).

    """

    def __init__(
        self,
        providers: Iterable[str],
        on_notice: OnNotice,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        self.providers = list(providers)
        self.on_notice = on_notice
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.aws_endpoint = env.get(AWS_ENDPOINT_ENV, "http://169.254.169.254").rstrip("/")
        self.gce_base = f"http://{env.get(GCE_HOST_ENV, 'metadata.google.internal')}/computeMetadata/v1/instance"
        self._token: tuple[str, float] | None = None  # the IMDSv2 token and when it expires (monotonic)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: set[str] = set()

    def start(self) -> NoticePoller:
        """Start polling (a no-op with no providers); returns self."""
        if self.providers and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="preemption-notices", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (waits for the request in progress, at most ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1.0)
            self._thread = None

    def poll_once(self) -> tuple[str, float] | None:
        """Ask every provider once: the first notice found (description, seconds left), or None."""
        for provider in self.providers:
            try:
                notice = self._aws() if provider == "aws" else self._gce()
            except (OSError, ValueError, KeyError) as error:  # URLError, timeouts, a malformed answer
                if provider not in self._failing:
                    self._failing.add(provider)
                    log.warning("preemption notices: no answer from the %s metadata server (%s)", provider, error)
                continue
            self._failing.discard(provider)
            if notice is not None:
                return notice
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            notice = self.poll_once()
            if notice is not None:
                self.on_notice(*notice)
                return
            self._stop.wait(self.interval_s)

    # ------------------------------------------------------------------ providers

    def _aws(self) -> tuple[str, float] | None:
        request = urllib.request.Request(
            f"{self.aws_endpoint}/latest/meta-data/spot/instance-action",
            headers={"X-aws-ec2-metadata-token": self._aws_token()},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                body = json.loads(answer.read().decode())
        except urllib.error.HTTPError as error:
            if error.code == 404:  # no notice: the instance is not being reclaimed
                return None
            if error.code == 401:  # the token expired early: fetch a new one next time
                self._token = None
            raise
        when = datetime.datetime.fromisoformat(str(body["time"]).replace("Z", "+00:00"))
        left = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
        return f"an AWS spot notice ({body.get('action', 'terminate')} at {body['time']})", max(left, 0.0)

    def _aws_token(self) -> str:
        """An IMDSv2 session token (PUT with a TTL), reused until a minute before it expires."""
        if self._token is not None and time.monotonic() < self._token[1]:
            return self._token[0]
        ttl = 21600
        request = urllib.request.Request(
            f"{self.aws_endpoint}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)},
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
            token = answer.read().decode()
        self._token = (token, time.monotonic() + ttl - 60)
        return token

    def _gce(self) -> tuple[str, float] | None:
        if self._gce_value("preempted").upper() == "TRUE":
            return "a GCE preemption notice", GCE_PREEMPTION_S
        event = self._gce_value("maintenance-event")
        if event.upper().startswith("TERMINATE"):
            return f"a GCE maintenance notice ({event})", GCE_MAINTENANCE_S
        return None

    def _gce_value(self, name: str) -> str:
        request = urllib.request.Request(f"{self.gce_base}/{name}", headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
            return answer.read().decode().strip()


def start_polling(settings: PreemptionNotices, on_notice: OnNotice) -> NoticePoller | None:
    """Start a poller for ``settings`` when any provider applies here; None otherwise."""
    providers = providers_for(settings.notices)
    if not providers:
        return None
    with contextlib.suppress(RuntimeError):  # no threads at interpreter shutdown
        return NoticePoller(providers, on_notice, interval_s=settings.poll_interval_s).start()
    return None
