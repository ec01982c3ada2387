"""A cloud metadata server on loopback that speaks the AWS (IMDSv2) and GCE protocols, for the preemption
notice tests and the torture script's ``notice`` fault.

Example::

    with FakeMetadataServer() as server:
        env = server.environment()                 # where the poller looks for both clouds
        server.post_aws_notice(seconds_from_now=20)
"""

from __future__ import annotations

import datetime
import http.server
import json
import threading
from typing import Any

AWS_TOKEN = "loopback-imds-token"


class FakeMetadataServer(http.server.ThreadingHTTPServer):
    """AWS: ``PUT /latest/api/token``, then with that token ``GET /latest/meta-data/spot/instance-action`` (404
    until a notice is posted). GCE: ``instance/preempted`` and ``instance/maintenance-event``, with the
    ``Metadata-Flavor: Google`` header. Counts tokens issued and requests refused for lack of one."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.aws_notice: dict[str, str] | None = None
        self.gce_preempted = "FALSE"
        self.gce_maintenance = "NONE"
        self.tokens_issued = 0
        self.requests_without_token = 0
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def environment(self) -> dict[str, str]:
        """The variables that point the clouds' SDKs (and our poller) at this server."""
        return {"AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://{self.address}", "GCE_METADATA_HOST": self.address}

    def post_aws_notice(self, seconds_from_now: float, action: str = "terminate") -> None:
        when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds_from_now)
        self.aws_notice = {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}

    def clear(self) -> None:
        """No notice any more (a relaunch on a VM that is staying)."""
        self.aws_notice, self.gce_preempted, self.gce_maintenance = None, "FALSE", "NONE"

    def __enter__(self) -> FakeMetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeMetadataServer

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _answer(self, code: int, body: str = "") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self.server.tokens_issued += 1
            return self._answer(200, AWS_TOKEN)
        return self._answer(400)

    def do_GET(self) -> None:
        if self.path.startswith("/latest/"):
            if self.headers.get("X-aws-ec2-metadata-token") != AWS_TOKEN:  # IMDSv2: no token, no answer
                self.server.requests_without_token += 1
                return self._answer(401)
            if self.path == "/latest/meta-data/spot/instance-action" and self.server.aws_notice:
                return self._answer(200, json.dumps(self.server.aws_notice))
            return self._answer(404)
        if self.headers.get("Metadata-Flavor") != "Google":
            return self._answer(403)
        values = {
            "/computeMetadata/v1/instance/preempted": self.server.gce_preempted,
            "/computeMetadata/v1/instance/maintenance-event": self.server.gce_maintenance,
        }
        return self._answer(200, values[self.path]) if self.path in values else self._answer(404)
