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
        started = time.perf_counter()
        summer.start([float(rank + 1)])
        returned_after = time.perf_counter() - started
        if profiler is not None:
            # A window closes at the next batch's start, after that batch's data fetch: not at once. (Stopping a
            # profiler within microseconds of any profiled gloo collective, even a synchronous one, can abort in
            # torch itself: c10d may still be ending the record on gloo's thread after wait() returned.)
            time.sleep(0.05)
            profiler.stop()
        record["profiled" if profiled else "plain"] = {"seconds": returned_after, "sum": summer.result()}
    return record


@pytest.mark.multiprocess
def test_a_sum_started_under_a_profiler_is_done_before_start_returns(tmp_path):
    # c10d ends a profiled collective's record on gloo's thread when it completes: a profiler stopped while the
    # sum is in flight leaves that thread writing into freed state (a heap-corruption abort, 1 run in 22).
    late_joiner_waited_for = on_two_ranks(_start_while_rank0_is_late, tmp_path)[1]
    assert late_joiner_waited_for["plain"]["sum"] == late_joiner_waited_for["profiled"]["sum"] == [3.0]
    assert late_joiner_waited_for["plain"]["seconds"] < 0.25  # in the background: returned before rank 0 came
    assert late_joiner_waited_for["profiled"]["seconds"] >= 0.4  # under the profiler: waited for rank 0
