"""The all-reduce probe on two real ranks: every rank reports the same figure, so a threshold decides alike."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.distributed.two_ranks import on_two_ranks


def _probe_with_rank_1_slow(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_mlopt.distributed.bandwidth import probe_all_reduce

    if rank == 1:  # a slow host: its own clock sees a longer probe than rank 0's
        time.sleep(0.3)
    dist.barrier()
    result = probe_all_reduce(1 << 16, torch.device("cpu"), warmup=1, iterations=3)
    return {"seconds": result.seconds, "busbw": result.busbw_gbps}


@pytest.mark.slow
def test_every_rank_reports_the_slowest_ranks_time(tmp_path):
    first, second = on_two_ranks(_probe_with_rank_1_slow, tmp_path)
    assert first == second, "one figure everywhere: a bandwidth threshold fails on every rank or on none"
    assert first["seconds"] > 0
