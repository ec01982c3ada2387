"""Shared fixtures: hygiene (no leaked process groups or threads) and a helper to run the real CLI."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# What a child process of the tests puts on its import path: the repository first, then what this process was
# given (a lent GPU machine installs carried packages under a PYTHONPATH folder; replacing it loses them).
REPO_PYTHONPATH = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """A test marked ``solo`` runs with no test of the other xdist worker beside it (``tests/support/solo.py``)."""
    from tests.support.solo import room

    with room(solo=item.get_closest_marker("solo") is not None):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """An unmarked test whose call runs past the fast tier's budget fails (``tests/support/fast_tier.py``)."""
    from tests.support.fast_tier import over_budget

    report = yield
    if call.when == "call" and report.passed:
        markers = {marker.name for marker in item.iter_markers()}
        why = over_budget(markers, call.duration, item.config.getoption("markexpr") or "")
        if why is not None:
            report.outcome, report.longrepr = "failed", why
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _hygiene() -> Iterator[None]:
    """Fail a test that leaves threads running; destroy any process group it left behind."""
    before = set(threading.enumerate())
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # MLflow keeps one artifact repository per run for the life of the process (a module-level cache), each with
    # an idle thread pool named Mlflow<Repository>: MLflow's design, not a thread of ours left running.
    leaked = [
        t
        for t in set(threading.enumerate()) - before
        if t.is_alive() and not t.daemon and t.name != "MainThread" and not t.name.startswith("Mlflow")
    ]
    assert not leaked, f"test leaked threads: {[t.name for t in leaked]}"


def cli_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a CLI run of the tests gets: this one, the repository importable, ``env`` on top."""
    full_env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("MASTER_PORT", None)
    return full_env


def run_cli(
    args: Sequence[str], cwd: Path, timeout: float = 300, env: dict[str, str] | None = None, preloaded: bool = False
):
    """Run ``python -m lightning_mlopt ARGS`` in a fresh process, as a user would; return the result.

    ``preloaded``: in processes forked from one that imported torch, Lightning and DeepSpeed already, every rank
    started at once as torchrun starts them (``tests/support/preloaded.py``): for runs whose subject is what
    training computes and writes, not how a launch starts or ends.
    """
    if preloaded:
        from tests.support.preloaded import run_preloaded

        return run_preloaded(args, cwd, cli_environment(env), timeout)
    return subprocess.run(
        [sys.executable, "-m", "lightning_mlopt", *args],
        cwd=cwd,
        env=cli_environment(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(
    args: Sequence[str], cwd: Path, env: dict[str, str] | None = None, preloaded: bool = False, **popen: Any
) -> Any:
    """Start ``python -m lightning_mlopt ARGS`` as a job of its own: a new session, so that a signal to its
    process group reaches every rank at once, as a scheduler's does (``os.killpg(job.pid, ...)``).

    Returns a :class:`subprocess.Popen`; with ``preloaded``, a :class:`tests.support.preloaded.PreloadedJob`
    (its ranks forked from the preloaded server: see :func:`run_cli`), whose output is read with
    ``communicate()`` (``popen`` is ignored).
    """
    if preloaded:
        from tests.support.preloaded import PreloadedJob

        return PreloadedJob(args, cwd, cli_environment(env))
    command = [sys.executable, "-m", "lightning_mlopt", *args]
    return subprocess.Popen(command, cwd=cwd, env=cli_environment(env), start_new_session=True, **popen)


def run_tool_here(
    name: str,
    args: Sequence[str],
    cwd: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run tool ``name`` (``python -m lightning_mlopt NAME ARGS``) in this process, as the entry point does.

    For tools that only read and write files: the test process has torch and Lightning loaded already, so a
    call costs milliseconds where a fresh process costs seconds of imports. ``env`` is set for the rest of the
    test. Trainer runs, and anything about signals or exit paths of a real process, go through :func:`run_cli`.
    """
    from lightning_mlopt.cli.commands import run_tool

    monkeypatch.chdir(cwd)
    for variable, value in (env or {}).items():
        monkeypatch.setenv(variable, value)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run_tool(name, args)
        except SystemExit as exit_:  # an argument parser's own exit
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess([name, *args], code, out.getvalue(), err.getvalue())


def failure_report(result: subprocess.CompletedProcess[str], tail: int = 2500) -> str:
    """What a failed multi-process run said: every error line of every rank (the first rank to fail is often
    not the one whose long traceback ends the output), then the end of stderr."""
    lines = (result.stdout + result.stderr).splitlines()
    errors = [line for line in lines if "Error" in line or "error:" in line or "Killed" in line][:40]
    crash = _native_crash_report(result.stderr.splitlines())
    return "error lines:\n" + "\n".join([*errors, *crash]) + f"\n--- end of stderr ---\n{result.stderr[-tail:]}"


def _native_crash_report(lines: list[str], most: int = 60) -> list[str]:
    """The fault handler's report of a native crash (``Fatal Python error: ...`` and the stacks after it)."""
    starts = [index for index, line in enumerate(lines) if line.startswith("Fatal Python error")]
    if not starts:
        return []
    return ["--- native crash ---", *lines[starts[0] : starts[0] + most]]


# Settings that make any config a 2-step smoke run.
SMOKE = [
    "--trainer.max_steps=2",
    "--trainer.max_epochs=1",
    # 2, not 1: the CLI's parser reads Lightning's int-or-float limit as a float, and 1.0 means the whole set.
    "--trainer.limit_val_batches=2",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false",
]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Mount a real tmpfs (full when its size is reached; read-only with ``read_only=True``) under tmp_path.

    A full or read-only disk as the kernel reports it (errno 28, errno 30), not a patched function. Needs root
    (CI runs as root); skipped where mounting is not permitted.
    """
    mounted: list[Path] = []

    def mount(name: str, size: str = "4m", read_only: bool = False) -> Path:
        point = tmp_path / name
        point.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


# Steps of the session's shared strategy runs, and a clip value small enough to be active at every step (it
# checks each strategy's global norm too).
SHARED_RUN_STEPS = 20
SHARED_RUN_CLIP_VALUE = 0.05
SHARED_RUN_CLIP = f"--trainer.gradient_clip_val={SHARED_RUN_CLIP_VALUE}"


@pytest.fixture(scope="session")
def strategy_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The GPT demo trained under DDP, FSDP and ZeRO-1/2/3 on 2 CPU processes, once per session.

    Maps each strategy to ``(records, params, run_dir)`` (``tests.support.strategy_runs.TrainedRun``). The strategy
    equivalence tests compare them; the checkpoint tool's tests read their checkpoints (read-only: a test that
    would write into a run directory trains its own run); the collective budget test reads the collectives each
    rank counted in batches ``COUNTED_STEPS`` (``collectives-rank<N>.json`` beside the records); GradNormMonitor's
    test reads the norms it logged at ``MONITORED_STEP`` (``tests/support/grad_norms.py``, in ``monitor/``).
    Sharing saves ten launches of the suite's budget.
    """
    from tests.support.grad_norms import MONITOR_FOLDER, monitor_args
    from tests.support.shared_session import built_once
    from tests.support.strategy_runs import train, trained_run

    names = ["ddp", "fsdp", "zero1", "zero2", "zero3"]

    def build(root: Path) -> None:
        for name in names:
            monitor = monitor_args(root / name / MONITOR_FOLDER, step=MONITORED_STEP, every=None)
            records = (*_count_collectives(root / name), *monitor)
            train(root, name, name, SHARED_RUN_STEPS, extra=(SHARED_RUN_CLIP, *records))

    root = built_once(tmp_path_factory, "strategy_runs", build)  # once, not once per pytest-xdist worker
    return {name: trained_run(root, name) for name in names}


# The batch whose collectives the shared runs record (tests/strategies/test_collective_budget.py): warm, clear of
# the first and last steps' one-off work, off a logging step. One batch: the profiler's Python tracer slows each
# batch it records several times over (ZeRO-3's most: 5 s a batch on 2 cores).
COUNTED_STEPS = (10, 11)
# The step whose gradient norms the shared runs' GradNormMonitor test compares. The monitor logs at the Trainer's
# period (gpt.yaml: 10), so its logging steps' extra all-reduce (update ratios) stays out of the counted batch; the
# last step, so the parameters gathered around it for the reference come after that batch (under ZeRO-3 a gather
# costs the next forward one more all-gather).
MONITORED_STEP = SHARED_RUN_STEPS


def _count_collectives(out: Path) -> tuple[str, ...]:
    return (
        "--trainer.callbacks+=tests.support.recorders.CountCollectives",
        f"--trainer.callbacks.out_dir={out}",
        f"--trainer.callbacks.first_step={COUNTED_STEPS[0]}",
        f"--trainer.callbacks.last_step={COUNTED_STEPS[1]}",
    )


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[Any]:
    """A real ``mlflow server`` (SQLite store) on loopback for one test, killed by pid at its end."""
    from tests.support.mlflow_server import MLflowServer

    with MLflowServer(tmp_path / "server") as server:
        yield server


@pytest.fixture(scope="session")
def moto_server() -> Iterator[Any]:
    """moto's S3-compatible server on loopback, for the whole session (started on first use, killed by pid)."""
    from tests.support.s3_server import MotoServer

    with MotoServer() as server:
        yield server


@pytest.fixture
def s3_bucket(moto_server: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the loopback S3 server, with this process's AWS environment pointed at it; its name."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    moto_server.create_bucket(name)
    for variable in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in moto_server.environment().items():
        monkeypatch.setenv(variable, value)
    return name
