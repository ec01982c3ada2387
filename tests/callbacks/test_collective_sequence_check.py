"""CollectiveSequenceCheck through the real CLI on 2 CPU processes: a rank-dependent collective, named in one line.

The GPT demo under DDP, with one rank issuing a collective the other does not at step 2
(``tests.support.models.StrayCollectiveGPT``):

- ``sync_dist``: ``self.log(..., sync_dist=True)`` inside a rank-0 branch; ``all_gather``: ``self.all_gather`` on
  rank 1. Each waits for a partner that never comes: NCCLHealthCheck's watchdog ends the job (124) and its
  first line, read from both ranks' recorders through the store, names the stray call and its line.
- ``shape``: both ranks all-reduce a metric of the same size but another shape. The collectives pair up and the
  step ends, wrongly; the check stops both ranks at the boundary (exit 1), and the checkpoint of that step is
  never written.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from lightning_mlopt.checkpoint import CheckpointStore
from tests.conftest import failure_report, run_cli
from tests.support.cli_args import fit_args

MODELS = Path(__file__).resolve().parents[1] / "support" / "models.py"


def _line_of(text: str) -> int:
    lines = MODELS.read_text().splitlines()
    return next(index for index, line in enumerate(lines, start=1) if text in line)


def _stray(tmp_path: Path, kind: str, stray_rank: int, *extra: str):  # type: ignore[no-untyped-def]
    return run_cli(
        fit_args(
            "--model=tests.support.models.StrayCollectiveGPT",
            f"--model.init_args.kind={kind}",
            f"--model.init_args.stray_rank={stray_rank}",
            "--trainer.limit_val_batches=0",
            "--trainer.callbacks+=lightning_mlopt.callbacks.NCCLHealthCheck",
            "--trainer.callbacks.watchdog.timeout=15",
            "--trainer.callbacks.probe_mb=0",
            *extra,
            strategy="ddp",
            steps=6,
            run_dir=tmp_path / "run",
        ),
        cwd=tmp_path,
        preloaded=True,
        timeout=240,
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("kind", "stray_rank", "expected"),
    [
        ("sync_dist", 0, "rank 0 barrier() at models.py:{line}; rank 1 issued no other, now in backward"),
        ("all_gather", 1, "rank 1 all_gather(2x float32[4]) at models.py:{line}; rank 0 issued no other, now in"),
    ],
)
def test_a_stray_collective_that_hangs_is_named_in_the_watchdogs_first_line(tmp_path, kind, stray_rank, expected):
    start = time.monotonic()
    result = _stray(tmp_path, kind, stray_rank)
    elapsed = time.monotonic() - start
    assert result.returncode == 124, failure_report(result)
    assert elapsed < 150, f"{elapsed:.0f} s: the watchdog (15 s) and the store wait (10 s) bound it"
    line = _line_of("sync_dist=True)  # the stray" if kind == "sync_dist" else "self.all_gather(torch.ones(4))")
    printed = result.stdout + result.stderr
    verdict = f"collectives: ranks diverged at collective #1 of step 2: {expected.format(line=line)}"
    assert verdict in printed, printed[-3000:]
    assert len(printed.splitlines()) <= 60, f"{len(printed.splitlines())} console lines:\n{printed}"
    for rank in (0, 1):
        dump = (tmp_path / "run" / "health" / f"hang-rank{rank}.txt").read_text()
        assert verdict in dump.splitlines()[1], "the dump leads with the same line, then the stacks"
        assert "faulthandler view" in dump
    assert printed.count("faulthandler view") == 0, "every thread's stack goes to the file, not the console"


@pytest.mark.multiprocess
@pytest.mark.parametrize("data", ["sized", "iterable"])
def test_collectives_that_pair_up_but_differ_stop_every_rank_at_the_boundary_and_nothing_of_the_step_is_saved(
    tmp_path, data
):
    """``iterable``: loaders without a length, so UnevenInputs exchanges at each batch's start and the step's
    segment is still open when the save comes: the save compares it first."""
    iterable = ["--data=tests.support.uneven.UnevenTokens", "--data.train_batches=[8, 8]"] if data == "iterable" else []
    result = _stray(tmp_path, "shape", 1, "--checkpoint.every_n_steps=1", "--checkpoint.keep.last=10", *iterable)
    assert result.returncode == 1, failure_report(result)
    line = _line_of("torch.distributed.all_reduce(torch.ones(shape))")
    printed = result.stdout + result.stderr
    # The step's number counts the save's collectives that ended the step before (a checkpoint every step).
    verdict = re.search(
        r"error: CollectivesDivergedError: ranks diverged at collective #\d+ of step 2: (.*?)\. No", printed
    )
    assert verdict is not None, failure_report(result)
    assert verdict[1] == (
        f"rank 0 all_reduce(float32[4]) at models.py:{line}; rank 1 all_reduce(float32[2, 2]) at models.py:{line}"
    )
    saved = CheckpointStore(tmp_path / "run" / "checkpoints").newest_valid()
    assert saved is not None and saved.step == 2, "step 2 diverged: its checkpoint (global step 3) was refused"
    assert "Traceback" not in printed and "frame #" not in printed, "a diagnosis, not a crash"
