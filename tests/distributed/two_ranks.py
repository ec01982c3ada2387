"""Run a function in real processes (two, or more) joined in one gloo group, and collect what each returned.

The processes fork from the tests' preloaded server (``tests/support/preloaded.py``), which imported torch once and
never ran an operator: a rank starts in milliseconds, not the seconds a spawned interpreter spends importing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any


def _rank_main(rank: int, target: Callable[[int], dict[str, Any]], init_file: str, out: str, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    record = target(rank)
    Path(f"{out}.{rank}").write_text(json.dumps(record))
    dist.destroy_process_group()


def on_two_ranks(target: Callable[[int], dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """``target(rank)`` on ranks 0 and 1 (a module-level function, pickled to each forked rank); their records.

    Example::

        records = on_two_ranks(_sum_my_rank, tmp_path)   # [{"sum": 1.0}, {"sum": 1.0}]
    """
    return on_ranks(target, folder, world=2)


def on_ranks(target: Callable[[int], dict[str, Any]], folder: Path, world: int) -> list[dict[str, Any]]:
    """``target(rank)`` on ``world`` ranks, as :func:`on_two_ranks` does; their records, by rank."""
    from tests.conftest import cli_environment
    from tests.support.preloaded import run_preloaded

    out = folder / "record"
    folder.mkdir(parents=True, exist_ok=True)
    rank_main = partial(_rank_main, target=target, init_file=str(folder / "init"), out=str(out), world=world)
    result = run_preloaded([], folder, cli_environment(), call=rank_main, ranks=world)
    said = result.stdout + result.stderr
    assert result.returncode == 0, f"a rank of {target} failed (status {result.returncode}):\n{said[-4000:]}"
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]
