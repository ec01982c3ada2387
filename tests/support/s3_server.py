"""A real S3-compatible server on loopback (moto's standalone server), and a proxy in front of it that fails
requests the way a network and a busy service do, for the object-store tests and the torture's ``--store s3``.

moto's server speaks the S3 HTTP API and answers a second create-only PUT and a stale ``If-Match`` PUT with
``PreconditionFailed``, as S3 does. It is started as its own process on a free port and stopped by pid.

Example::

    with MotoServer() as server:
        env = server.environment()          # AWS_ENDPOINT_URL and test credentials, for boto3 and our runs
        server.create_bucket("ckpt")
        with FaultyProxy(server.port, fail=lambda request: request.part_number == 2) as proxy:
            ...                             # AWS_ENDPOINT_URL=proxy.endpoint: part 2 of every upload fails
"""

from __future__ import annotations

import http.client
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ACCESS_KEY = "loopback-access-key"
SECRET_KEY = "loopback-secret-do-not-log"  # tests assert it never appears in output


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class MotoServer:
    """``python -m moto.server`` on ``127.0.0.1:<free port>``, ready when entered, killed on exit.

    ``check_credentials``: the server refuses keys it does not know (moto's IAM authentication), as S3 does.
    """

    def __init__(self, check_credentials: bool = False) -> None:
        self.port = free_port()
        self.check_credentials = check_credentials
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self, endpoint: str | None = None) -> dict[str, str]:
        """What points boto3 (and so our runs) at this server, with credentials it accepts."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # never wait for an instance-metadata credential lookup
        }

    def client(self) -> Any:
        import boto3

        env = self.environment()
        return boto3.session.Session(
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        ).client("s3", endpoint_url=self.endpoint)

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def __enter__(self) -> MotoServer:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env={**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if self.check_credentials else {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"moto.server exited with status {self._process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("moto.server did not listen within 60 s")

    def __exit__(self, *exc: Any) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()


@dataclass(frozen=True)
class ProxiedRequest:
    """What the proxy's ``fail`` rule sees of a request."""

    method: str
    path: str
    query: dict[str, str]

    @property
    def part_number(self) -> int | None:
        """The part of a multipart upload (``UploadPart``), else None."""
        return int(self.query["partNumber"]) if "partNumber" in self.query else None


class FaultyProxy(http.server.ThreadingHTTPServer):
    """An HTTP proxy on loopback in front of a server; requests ``fail`` selects are failed.

    ``how``: ``"reset"`` closes the connection without an answer (a dropped connection mid-upload),
    ``"slowdown"`` answers 503 ``SlowDown`` (S3's throttling). ``failed`` counts the requests failed.
    """

    def __init__(self, target_port: int, fail: Callable[[ProxiedRequest], bool], how: str = "reset") -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.target_port = target_port
        self.fail = fail
        self.how = how
        self.failed = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def count_failure(self) -> None:
        with self._lock:
            self.failed += 1

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
        self.server_close()


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: FaultyProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _relay(self) -> None:
        parsed = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(parsed.query, keep_blank_values=True))
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.server.fail(ProxiedRequest(self.command, parsed.path, query)):
            self.server.count_failure()
            if self.server.how == "slowdown":
                text = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
            else:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.target_port, timeout=60)
        headers = {name: value for name, value in self.headers.items() if name.lower() != "transfer-encoding"}
        upstream.request(self.command, self.path, body=body, headers=headers)
        response = upstream.getresponse()
        data = response.read()
        self.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(name, value)
        head = self.command == "HEAD"  # its Content-Length is the object's size, with no body
        self.send_header("Content-Length", response.getheader("Content-Length", "0") if head else str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)
        upstream.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay
