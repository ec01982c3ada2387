"""A cloud metadata server on loopback for the ``notice`` fault: AWS IMDSv2 (token, then the spot notice).

Example::

    with FakeMetadataServer() as server:          # env: AWS_EC2_METADATA_SERVICE_ENDPOINT=server.url
        server.post_aws_notice(seconds_from_now=20)
"""

from __future__ import annotations

import datetime
import http.server
import json
import threading
from typing import Any


class FakeMetadataServer(http.server.ThreadingHTTPServer):
    """Answers ``PUT /latest/api/token`` and, with that token, ``GET /latest/meta-data/spot/instance-action``."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.notice: dict[str, str] | None = None
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def post_aws_notice(self, seconds_from_now: float) -> None:
        when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds_from_now)
        self.notice = {"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}

    def clear(self) -> None:
        self.notice = None

    def __enter__(self) -> FakeMetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeMetadataServer

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, code: int, body: str = "") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._answer(200, "torture-token")
        return self._answer(400)

    def do_GET(self) -> None:
        if self.headers.get("X-aws-ec2-metadata-token") != "torture-token":
            return self._answer(401)
        if self.path == "/latest/meta-data/spot/instance-action" and self.server.notice:
            return self._answer(200, json.dumps(self.server.notice))
        return self._answer(404)
