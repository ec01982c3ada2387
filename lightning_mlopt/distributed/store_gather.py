"""Every rank's text through the job's key-value store, for when a collective cannot be trusted.

A rank stuck in a collective, or ranks whose collectives no longer pair up, cannot gather anything with
another collective; the store the process group was made with still answers (it is a TCP server, not a
communicator). Each rank sets its key, polls for the others' until a deadline, reads what is there, and says
it has read; rank zero then waits (briefly) for every rank to have read: it hosts the store under
Lightning's launcher, and must not exit, and take the store with it, before the others are done with it.
The others touch the store no more after saying so.

Example::

    texts = gather_through_store(default_store(), "mlopt/hang/17", rank, world, "rank 0 waits in all_reduce")
    texts  # {0: "rank 0 waits in all_reduce", 1: "..."}; a rank that never set its key is absent
"""

from __future__ import annotations

import time
from typing import Any

POLL_S = 0.05
HOST_LINGER_S = 0.2


def gather_through_store(store: Any, prefix: str, rank: int, world: int, text: str, wait_s: float) -> dict[int, str]:
    """Every rank's ``text`` under ``prefix``, waiting up to ``wait_s`` for the others; missing ranks absent.

    Never raises for a store that stops answering (its host exited): what was read by then is returned.
    """
    texts = {rank: text}
    if store is None:  # no process group (any more): this rank's own is all there is
        return texts
    try:
        store.set(f"{prefix}/{rank}", text.encode())
        _wait_for(store, [f"{prefix}/{other}" for other in range(world)], wait_s)
        for other in range(world):
            key = f"{prefix}/{other}"
            if other != rank and store.check([key]):
                texts[other] = store.get(key).decode()
        store.set(f"{prefix}/read/{rank}", b"1")
        if rank == 0:  # the store's host under Lightning's launcher: it stays until every rank has read
            _wait_for(store, [f"{prefix}/read/{other}" for other in texts], min(wait_s, 5.0))
            time.sleep(HOST_LINGER_S)  # the last reader's reply is on its way
    except (RuntimeError, ValueError, OSError):  # the store's host is gone: what was read is all there is
        pass
    return texts


def _wait_for(store: Any, keys: list[str], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(POLL_S)
