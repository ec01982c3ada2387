"""BackgroundSum: the sum runs while training goes on, except under a recording profiler, where it ends at once."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.distributed.two_ranks import on_two_ranks


def _start_while_rank0_is_late(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_mlopt.distributed.background_sum import BackgroundSum

    record = {}
    for profiled in (False, True):
        summer = BackgroundSum()
        dist.barrier()
        if rank == 0:
            time.sleep(0.5)  # rank 1's sum cannot end before rank 0 joins it
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profiled else None
        if profiler is not None:
            profiler.start()
        # CLOCK_MONOTONIC is one clock for every process of this machine: the ranks' instants compare directly.
        # (A duration would not: the profiler's own start can take a few hundred milliseconds of rank 0's delay.)
        called_at = time.monotonic()
        summer.start([float(rank + 1)])
        returned_at = time.monotonic()
        if profiler is not None:
            # A window closes at the next batch's start, after that batch's data fetch: not at once. (Stopping a
            # profiler within microseconds of any profiled gloo collective, even a synchronous one, can abort in
            # torch itself: c10d may still be ending the record on gloo's thread after wait() returned.)
            time.sleep(0.05)
            profiler.stop()
        record["profiled" if profiled else "plain"] = {
            "called_at": called_at,
            "returned_at": returned_at,
            "sum": summer.result(),
        }
    return record


@pytest.mark.multiprocess
def test_a_sum_started_under_a_profiler_is_done_before_start_returns(tmp_path):
    # c10d ends a profiled collective's record on gloo's thread when it completes: a profiler stopped while the
    # sum is in flight leaves that thread writing into freed state (a heap-corruption abort, 1 run in 22).
    late, early = on_two_ranks(_start_while_rank0_is_late, tmp_path)
    assert early["plain"]["sum"] == early["profiled"]["sum"] == [3.0]
    # In the background: rank 1's start returned before rank 0 had even called its own.
    assert early["plain"]["returned_at"] < late["plain"]["called_at"]
    # Under the profiler: rank 1's start returned only once rank 0 had joined the sum.
    assert early["profiled"]["returned_at"] >= late["profiled"]["called_at"]
