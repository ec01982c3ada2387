"""CLI runs for the tests that pay torch's, Lightning's and DeepSpeed's imports once, not once per rank and launch.

A ``python -m lightning_mlopt fit`` on 2 CPU processes spends most of its time importing: rank zero imports,
builds its Trainer, then Lightning's launcher starts rank one, which imports again (about 13 s of a short run's
17 on this 2-core machine). Here one server process per test worker imports everything once and, for each run,
forks one fresh process per rank with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``): every rank starts at once, already imported, and
runs the CLI's own entry point (``lightning_mlopt.__main__.run``) as ``python -m`` would. Each run keeps process
isolation (our process-wide patches rule out running ranks in the test process).

What differs from a real launch, on purpose: the ranks are started as torchrun starts them, not by Lightning's
launcher; the process has torch imported before the entry point runs. So tests about start-up, signals, exit
statuses of launcher-started ranks, or environment read at import (``OMP_NUM_THREADS``) launch for real
(:func:`tests.conftest.run_cli`); runs whose subject is what training computes and writes come here.

The server is single-threaded (it only accepts and forks), so forking it is safe; torch has started no thread
pool in it (nothing ran).

Example::

    result = run_preloaded(fit_args("--trainer.max_steps=3", strategy="ddp", run_dir=run), cwd=tmp_path)
    assert result.returncode == 0
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_SERVER: tuple[subprocess.Popen[bytes], Path] | None = None
_JOB_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
_PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "deepspeed", "lightning_mlopt.cli.entry")


def ranks_of(args: Sequence[str]) -> int:
    """The world size a command line asks for: ``--trainer.devices=N`` (1 without it)."""
    devices = [arg.split("=", 1)[1] for arg in args if arg.startswith("--trainer.devices=")]
    return int(devices[-1]) if devices and devices[-1].isdigit() else 1


def run_preloaded(
    args: Sequence[str],
    cwd: Path,
    env: dict[str, str],
    timeout: float = 300,
    call: Callable[..., Any] | None = None,
    ranks: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m lightning_mlopt ARGS`` on ``ranks_of(args)`` forked, pre-imported processes; the run's status.

    The status is rank zero's, or, where rank zero exited 0, the first other rank's that did not. With ``call``
    (a picklable callable) each of ``ranks`` processes runs ``call(rank)`` instead of the CLI (see
    :class:`PreloadedJob`). A wait that ends any other way than with the job (a timeout, an interrupt) kills it.

    stdout and stderr are every rank's, as a launch's are (the ranks share the two files).
    """
    job = PreloadedJob(args, cwd, env, call=call, ranks=ranks)
    try:
        job.wait(timeout)
    except BaseException:
        job.kill()
        raise
    finally:
        result = subprocess.CompletedProcess(["preloaded", *args], job.returncode, job.stdout_text(), job.stderr_text())
        job.remove_outputs()
    return result


def fork_tools_child_fits(monkeypatch: Any) -> None:
    """Make the fits a tool starts (``parity``'s runs, ``profile``'s measurements, a sweep's trials) preloaded jobs.

    For a tool run in the test process (:func:`tests.conftest.run_tool_here`) whose subject is what it compares or
    measures, not how its children start: each child's ranks fork from the server instead of ``python -m``.
    Signals to the tool are not forwarded (a test of forwarding launches for real).
    """

    def run(command: Sequence[str], log: Any, env: dict[str, str]) -> tuple[int, bool]:
        from tests.conftest import cli_environment

        assert list(command[1:3]) == ["-m", "lightning_mlopt"], command  # the tool's ``command_line``
        job = PreloadedJob(list(command[3:]), Path.cwd(), cli_environment(env))
        try:
            return job.wait(300), False
        finally:
            log.write((job.stdout_text() + job.stderr_text()).encode())
            log.flush()
            job.remove_outputs()

    monkeypatch.setattr("lightning_mlopt.process.child.run_forwarding_signals", run)
    monkeypatch.setattr("lightning_mlopt.tools.sweep.runner.run_forwarding_signals", run)
    monkeypatch.setattr("lightning_mlopt.tools.sweep.probe.run_forwarding_signals", run)


class PreloadedJob:
    """A preloaded run in the background, with what a test uses of :class:`subprocess.Popen` to signal a job.

    ``pid`` is the job's leader, in a session of its own with the ranks: ``os.killpg(job.pid, signal.SIGTERM)``
    reaches every rank at once, as a scheduler's signal does (the leader ignores it and reports the ranks'
    status); after ``SIGKILL`` to the group, whose leader dies too, the status is ``-9``, as Popen reports it.

    Example::

        job = PreloadedJob(fit_args(...), tmp_path, cli_environment())
        os.killpg(job.pid, signal.SIGTERM)
        assert job.wait(120) == 75
    """

    def __init__(
        self,
        args: Sequence[str],
        cwd: Path,
        env: dict[str, str],
        call: Callable[..., Any] | None = None,
        ranks: int | None = None,
    ) -> None:
        """``call``: a picklable callable each rank runs as ``call(rank)`` instead of the CLI, on ``ranks`` ranks."""
        self.args = list(args)
        self._folder = Path(tempfile.mkdtemp(prefix="preloaded-"))
        self._out, self._err = self._folder / "stdout", self._folder / "stderr"
        pickled = None if call is None else pickle.dumps(call).hex()  # by reference, as multiprocessing sends it
        request = {"args": self.args, "cwd": str(cwd), "env": env, "ranks": ranks or ranks_of(args), "call": pickled}
        request |= {"out": str(self._out), "err": str(self._err)}
        self._connection = socket.socket(socket.AF_UNIX)
        self._connection.connect(str(_server_socket()))
        self._connection.sendall(json.dumps(request).encode() + b"\n")
        self._received = b""
        self.returncode: int | None = None
        self.pid = int(self._line(timeout=60))

    def poll(self) -> int | None:
        """The status if the job ended, else None (never blocks)."""
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._finish(self._line(timeout=5))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the job's status; ``subprocess.TimeoutExpired`` after ``timeout`` seconds (None: forever)."""
        if self.returncode is None:
            try:
                self._finish(self._line(timeout))
            except TimeoutError:
                raise subprocess.TimeoutExpired(["preloaded", *self.args], timeout or 0) from None
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Wait, then every rank's stdout and stderr, as bytes (as Popen's with ``PIPE``)."""
        self.wait(timeout)
        return self.stdout_text().encode(), self.stderr_text().encode()

    def kill(self) -> None:
        """SIGKILL the job, every rank and the leader."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    def remove_outputs(self) -> None:
        """Delete the files that hold the ranks' output (read them first)."""
        shutil.rmtree(self._folder, ignore_errors=True)

    def stdout_text(self) -> str:
        return self._out.read_text() if self._out.is_file() else ""

    def stderr_text(self) -> str:
        return self._err.read_text() if self._err.is_file() else ""

    def _line(self, timeout: float | None) -> str:
        """The next line the leader sends; '' when it closed the connection (it was killed)."""
        self._connection.settimeout(timeout)
        while b"\n" not in self._received:
            chunk = self._connection.recv(4096)
            if not chunk:
                return ""
            self._received += chunk
        line, _, self._received = self._received.partition(b"\n")
        return line.decode()

    def _finish(self, line: str) -> None:
        self.returncode = int(line) if line.strip() else -signal.SIGKILL  # the leader died with its ranks
        self._connection.close()


# A server another process started, for this one's jobs (tests/support/preloaded_client.py: a docs block's command).
SERVER_ENV = "LIGHTNING_MLOPT_TESTS_PRELOADED"


def server_socket() -> Path:
    """The socket of this test process's server, started on first use (its imports: seconds, once).

    A process given ``SERVER_ENV`` (a socket path) uses that server instead of starting its own.

    Example::

        env = {SERVER_ENV: str(server_socket())}  # a child process's jobs fork from this test's server
    """
    return _server_socket()


def _server_socket() -> Path:
    global _SERVER
    if os.environ.get(SERVER_ENV):
        return Path(os.environ[SERVER_ENV])
    if _SERVER is not None and _SERVER[0].poll() is None:
        return _SERVER[1]
    path = Path(tempfile.mkdtemp(prefix="preload-")) / "socket"
    from tests.conftest import REPO_PYTHONPATH

    environment = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "DS_ACCELERATOR": "cpu"}
    log = path.with_name("server.log")
    with log.open("wb") as output:  # what the imports print stays out of the tests' output
        server = subprocess.Popen(
            [sys.executable, "-c", f"from tests.support.preloaded import serve; serve({str(path)!r})"],
            env=environment,
            stdout=output,
            stderr=output,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while not path.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"the preloading server did not start (status {server.poll()}):\n{log.read_text()}")
        time.sleep(0.05)
    _SERVER = (server, path)
    import atexit

    atexit.register(server.kill)
    return path


def serve(path: str) -> None:
    """The server: import once, then fork a job leader per request (which forks the ranks and reports)."""
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # leaders are reaped by the kernel; the server never waits
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".tmp")
    listener.listen(8)
    os.rename(path + ".tmp", path)  # the client waits for the name: it exists once it accepts
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            _lead(connection)
        connection.close()


def _lead(connection: socket.socket) -> None:
    """A job leader: its own session (the client kills it, ranks included, on a timeout), one fork per rank."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for name in _JOB_SIGNALS:  # a signal to the job is for its ranks: the leader stays to report their status
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        request = json.loads(connection.makefile("r").readline())
        connection.sendall(f"{os.getpid()}\n".encode())
        ranks = int(request["ranks"])
        port = _free_port()
        pids = [_fork_rank(request, rank, ranks, port) for rank in range(ranks)]
        statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        # Rank zero's status, as Lightning's launcher reports it; but a rank that failed alone fails the run.
        code = statuses[0] or next((status for status in statuses if status), 0)
        connection.sendall(f"{code}\n".encode())
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(0)


def _fork_rank(request: dict[str, Any], rank: int, world: int, port: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for name in _JOB_SIGNALS:  # as a freshly started process has them
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if world > 1:  # torchrun's environment: every rank started at once, none by Lightning's launcher
            os.environ.update(
                RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), NODE_RANK="0",
                WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=f"preloaded-{port}",
            )  # fmt: skip
        code = _run_call(request["call"], rank) if request["call"] else _run_entry_point(request["args"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_entry_point(args: list[str]) -> int:
    """``python -m lightning_mlopt ARGS`` in this process: its status, its exit handlers run."""
    import lightning_mlopt.__main__ as entry
    from lightning_mlopt._compat import run_exit_handlers

    sys.argv = [entry.__file__, *args]
    try:
        entry.run()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    run_exit_handlers()  # as the interpreter would at exit (W&B's flush, our journals)
    return code


def _run_call(pickled: str, rank: int) -> int:
    """``call(rank)`` for the pickled callable (hex), in this process: 0, or 1 if it raised."""
    try:
        pickle.loads(bytes.fromhex(pickled))(rank)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
