"""Run a function in real processes (two, or more) joined in one gloo group, and collect what each returned.

The processes fork from the tests' preloaded server (``tests/support/preloaded.py``), which imported torch once and
never ran an operator: a rank starts in milliseconds, not the seconds a spawned interpreter spends importing.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any


def rank_main(rank: int, target: str, init_file: str, out: str, world: str) -> None:
    """One rank: join the gloo group, run ``target`` (a pickled callable, hex), write its record as JSON."""
    import pickle

    import torch.distributed as dist

    function = pickle.loads(bytes.fromhex(target))  # the test's own module-level function (or a partial of one)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=int(world))
    record = function(rank)
    Path(f"{out}.{rank}").write_text(json.dumps(record))
    dist.destroy_process_group()


def on_two_ranks(target: Callable[[int], dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """``target(rank)`` on ranks 0 and 1 (a module-level function: each rank is a spawned process); their records.

    Example::

        records = on_two_ranks(_sum_my_rank, tmp_path)   # [{"sum": 1.0}, {"sum": 1.0}]
    """
    return on_ranks(target, folder, world=2)


def on_ranks(target: Callable[[int], dict[str, Any]], folder: Path, world: int) -> list[dict[str, Any]]:
    """``target(rank)`` on ``world`` ranks, as :func:`on_two_ranks` does; their records, by rank."""
    from tests.conftest import cli_environment
    from tests.support.preloaded import PreloadedJob

    out = folder / "record"
    folder.mkdir(parents=True, exist_ok=True)
    function = pickle.dumps(target).hex()  # by reference, as multiprocessing's spawn sent it
    job = PreloadedJob(
        [function, str(folder / "init"), str(out), str(world)],
        folder,
        cli_environment(),
        call=f"{__name__}:rank_main",
        ranks=world,
    )
    try:
        status = job.wait(timeout=300)
    except BaseException:
        job.kill()
        raise
    said = job.stdout_text() + job.stderr_text()
    job.remove_outputs()
    assert status == 0, f"a rank of {target} failed (status {status}):\n{said[-4000:]}"
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]
