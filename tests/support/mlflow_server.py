"""A real MLflow tracking server on loopback (``mlflow server`` with a SQLite store and a local artifact folder).

Started as its own process group on a free port and stopped by pid; :meth:`MLflowServer.stop` and
:meth:`MLflowServer.start` again keep the same port and store, as a server that goes down and comes back.

Example::

    with MLflowServer(tmp_path / "mlflow") as server:
        client = server.client()
        server.stop()   # down: clients get connection errors
        server.start()  # back, with everything it had
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.s3_server import free_port


class MLflowServer:
    """``mlflow server`` on ``127.0.0.1:<free port>`` with its store in ``folder``; ready when entered."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        mlflow = Path(sys.executable).with_name("mlflow")
        command = [
            str(mlflow) if mlflow.exists() else "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.folder / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.folder / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        log = (self.folder / "server.log").open("ab")
        self._process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self._process.returncode}; see {log.name}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer on {self.uri} within {timeout} s")

    def stop(self) -> None:
        """Kill the server's whole process group (uvicorn's workers too) and wait for it."""
        if self._process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait(timeout=30)
        self._process = None

    def client(self) -> Any:
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def __enter__(self) -> MLflowServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
