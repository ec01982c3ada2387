"""HangWatchdog alone, with the process exit replaced: it waits while steps finish, and on a hang names the
step and the phase, writes every thread's stack to a file, and exits with its status once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_mlopt.process import phase
from lightning_mlopt.process.startup import StartupGuard
from lightning_mlopt.process.watchdog import HangWatchdog


class _Exits:
    """Stands in for ``os._exit``: records the status instead of ending the test process."""

    def __init__(self) -> None:
        self.codes: list[int] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


def test_beats_keep_it_quiet_and_stop_ends_the_thread(tmp_path: Path) -> None:
    exits = _Exits()
    watchdog = HangWatchdog(lambda: 0.3, tmp_path, rank=0, exit_code=124, poll_seconds=0.02, exit_process=exits)
    watchdog.start()
    for _ in range(15):  # 0.6 s in all, twice the limit, never 0.3 s without a beat
        time.sleep(0.04)
        watchdog.beat()
    watchdog.stop()
    assert exits.codes == [] and not list(tmp_path.iterdir())
    assert "hang-watchdog-rank0" not in {thread.name for thread in threading.enumerate()}  # joined


def test_a_hang_is_named_dumped_and_exits_once_with_its_status(tmp_path: Path, capsys) -> None:
    exits = _Exits()
    dumps = tmp_path / "health"
    watchdog = HangWatchdog(lambda: 0.2, dumps, rank=3, exit_code=124, poll_seconds=0.02, exit_process=exits)
    phase.set_phase("backward", step=17)
    watchdog.start()
    deadline = time.monotonic() + 5
    while not exits.codes and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # a second report would come within a few polls
    watchdog.stop()
    phase.set_phase("setup", step=0)
    assert exits.codes == [124]
    dump = (dumps / "hang-rank3.txt").read_text()
    header = dump.splitlines()[0]
    assert header.startswith("HANG on rank 3: no training step finished for")
    assert "last step 17, phase 'backward'" in header and "exiting with status 124" in header
    assert 'Thread "MainThread"' in dump and "faulthandler view" in dump  # every thread, Python and C views
    assert "test_a_hang_is_named_dumped_and_exits_once" in dump  # the main thread's own frame is in it
    assert dump.splitlines()[1].startswith("collectives: not recorded (add CollectiveSequenceCheck")
    err = capsys.readouterr().err
    assert header in err and f"(every thread's stack: {dumps / 'hang-rank3.txt'})" in err
    assert "faulthandler view" not in err and 'Thread "MainThread"' not in err, "the stacks go to the file only"
    assert len(err.splitlines()) <= 3 + 2 * 4 + 1, "verdict, collectives line, 4 innermost frames, the path"


def test_the_report_leads_with_the_collectives_line_and_a_failing_one_does_not_stop_the_exit(tmp_path: Path) -> None:
    lines = iter(["ranks diverged at collective #1 of step 2: rank 0 barrier() at model.py:42"])

    def describe() -> str:
        line = next(lines, None)
        if line is None:
            raise RuntimeError("store gone")
        return line

    for expected in ("collectives: ranks diverged at collective #1", "collectives: could not be compared"):
        exits = _Exits()
        watchdog = HangWatchdog(
            lambda: 0.1, tmp_path, rank=0, exit_code=124, poll_seconds=0.02, exit_process=exits, describe=describe
        )
        watchdog.start()
        deadline = time.monotonic() + 5
        while not exits.codes and time.monotonic() < deadline:
            time.sleep(0.02)
        watchdog.stop()
        assert exits.codes == [124]
        assert (tmp_path / "hang-rank0.txt").read_text().splitlines()[1].startswith(expected)


def test_an_adaptive_limit_is_read_at_every_poll(tmp_path: Path) -> None:
    exits = _Exits()
    limit = [60.0]
    watchdog = HangWatchdog(lambda: limit[0], tmp_path, rank=0, exit_code=124, poll_seconds=0.02, exit_process=exits)
    watchdog.start()
    time.sleep(0.15)
    assert exits.codes == []  # well inside a minute
    limit[0] = 0.05  # e.g. the limit adapted to short steps
    deadline = time.monotonic() + 5
    while not exits.codes and time.monotonic() < deadline:
        time.sleep(0.02)
    watchdog.stop()
    assert exits.codes == [124]


def test_an_orphaned_rank_leaves_its_dump_when_its_step_ran_half_the_limit(tmp_path: Path) -> None:
    """All watchdogs fire together; when the launching rank exits first, the hung rank ends as an orphan before
    its own watchdog looked: the guard's orphan exit has it write the dump first (a flake seen once in CI)."""
    guard, exits = StartupGuard(), _Exits()
    watchdog = HangWatchdog(
        lambda: 0.4, tmp_path, rank=1, exit_code=124, poll_seconds=60, exit_process=exits, guard=guard
    )
    phase.set_phase("forward", step=3)
    watchdog.start()
    guard._say_last_words("the process that launched this rank (pid 812) is gone")
    assert not (tmp_path / "hang-rank1.txt").exists(), "a step 0.0 s old is no hang: nothing to report"
    time.sleep(0.25)  # more than half the 0.4 s limit, less than the limit: the watchdog itself has not fired
    guard._say_last_words("the process that launched this rank (pid 812) is gone")
    watchdog.stop()
    phase.set_phase("setup", step=0)
    dump = (tmp_path / "hang-rank1.txt").read_text()
    assert dump.startswith("HANG on rank 1: no training step finished for 0 s (limit 0 s); last step 3")
    assert "phase 'forward'" in dump.splitlines()[0]
    assert "(pid 812) is gone, so this rank exits" in dump.splitlines()[0]
    assert "test_an_orphaned_rank_leaves_its_dump" in dump and exits.codes == []  # the guard, not it, ends the rank
    assert guard._last_words == [], "a stopped watchdog says nothing at a later exit"


def test_a_waiting_rank_whose_peer_left_exits_as_a_hang_once_its_step_ran_half_the_limit(tmp_path: Path) -> None:
    """The rank that hung exits first and the collective of the rank waiting for it fails: that rank ends as a
    hang too (dump, status 124), not as a crash, unless its step is young (then the failure is something else)."""
    exits = _Exits()
    watchdog = HangWatchdog(lambda: 0.4, tmp_path, rank=0, exit_code=124, poll_seconds=60, exit_process=exits)
    phase.set_phase("backward", step=3)
    watchdog.start()
    watchdog.exit_if_stuck("a collective failed because a peer left (Connection closed by peer)")
    assert exits.codes == [] and not (tmp_path / "hang-rank0.txt").exists()
    time.sleep(0.25)
    watchdog.exit_if_stuck("a collective failed because a peer left (Connection closed by peer)")
    watchdog.stop()
    phase.set_phase("setup", step=0)
    assert exits.codes == [124]
    header = (tmp_path / "hang-rank0.txt").read_text().splitlines()[0]
    assert "last step 3, phase 'backward'" in header and "because a peer left (Connection closed" in header


def test_an_exit_waits_for_the_dump_another_thread_is_writing(tmp_path: Path, monkeypatch) -> None:
    """The orphan's last words and the watchdog firing at once: whichever thread exits must not cut the other's
    dump short (CI once saw status 124 and no hang-rank1.txt)."""
    from lightning_mlopt.process import watchdog as watchdog_module

    slow_stacks = watchdog_module._format_stacks

    def _slowly() -> str:
        time.sleep(0.3)
        return slow_stacks()

    monkeypatch.setattr(watchdog_module, "_format_stacks", _slowly)
    seen_at_exit: list[bool] = []
    dump = tmp_path / "hang-rank1.txt"
    watchdog = HangWatchdog(
        lambda: 0.01,
        tmp_path,
        rank=1,
        exit_code=124,
        poll_seconds=60,
        exit_process=lambda _: seen_at_exit.append(dump.exists()),
    )
    watchdog.start()
    time.sleep(0.05)
    last_words = threading.Thread(target=watchdog.dump_if_stuck, args=("the launcher is gone",))
    last_words.start()
    time.sleep(0.05)  # the last words are formatting the stacks now
    watchdog.exit_if_stuck("a peer left")
    last_words.join()
    watchdog.stop()
    assert seen_at_exit == [True]
    assert "the launcher is gone" in dump.read_text().splitlines()[0]


def test_peer_loss_is_told_from_other_errors() -> None:
    import torch.distributed as dist

    from lightning_mlopt.distributed.peer_loss import is_peer_loss

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:38309. This is typically caused by a remote worker crashing."
    )
    assert is_peer_loss(gloo)
    assert is_peer_loss(dist.DistBackendError("NCCL error: remote process exited or there was a network error"))
    wrapped = ValueError("step failed")
    wrapped.__cause__ = gloo
    assert is_peer_loss(wrapped)
    assert not is_peer_loss(RuntimeError("CUDA out of memory"))
    assert not is_peer_loss(ValueError("connection closed by peer"))  # not a transport's error type


_LAUNCHER = """
import os, subprocess, sys, time
child = subprocess.Popen(
    [sys.executable, "-c", "from lightning_mlopt.process.exit import exit_hung_rank; exit_hung_rank(124)"],
    env={**os.environ, "LOCAL_RANK": "1"},
)
time.sleep(1.5)
print(child.pid, child.poll(), flush=True)  # still waiting for this launcher: None
"""


@pytest.mark.slow
def test_a_launched_rank_whose_watchdog_fired_exits_only_after_its_launcher(tmp_path: Path) -> None:
    """Lightning's launcher SIGKILLs rank zero when a child exits non-zero first: the job's 124 would be -9."""
    launcher = subprocess.run([sys.executable, "-c", _LAUNCHER], capture_output=True, text=True, timeout=60)
    assert launcher.returncode == 0, launcher.stderr
    pid, status_while_launcher_lived = launcher.stdout.split()
    assert status_while_launcher_lived == "None", "the launched rank left before its launcher"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the launched rank outlived its launcher by 10 s")
