"""BackgroundSum: the sum runs while training goes on, except under a recording profiler, where it ends at once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch


def _start_while_rank0_is_late(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    from lightning_mlopt.distributed.background_sum import BackgroundSum

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
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
            profiler.stop()  # what a profiling window closing at the next batch does
        record["profiled" if profiled else "plain"] = {"seconds": returned_after, "sum": summer.result()}
    Path(f"{out}.{rank}").write_text(json.dumps(record))
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_a_sum_started_under_a_profiler_is_done_before_start_returns(tmp_path):
    # c10d ends a profiled collective's record on gloo's thread when it completes: a profiler stopped while the
    # sum is in flight leaves that thread writing into freed state (a heap-corruption abort, 1 run in 22).
    import torch.multiprocessing as mp

    out = tmp_path / "record"
    mp.spawn(_start_while_rank0_is_late, args=(str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    late_joiner_waited_for = json.loads(Path(f"{out}.1").read_text())
    assert late_joiner_waited_for["plain"]["sum"] == late_joiner_waited_for["profiled"]["sum"] == [3.0]
    assert late_joiner_waited_for["plain"]["seconds"] < 0.25  # in the background: returned before rank 0 came
    assert late_joiner_waited_for["profiled"]["seconds"] >= 0.4  # under the profiler: waited for rank 0
