"""Tell a collective that failed because a peer process is gone from any other error.

When one rank of a job exits (its hang watchdog fired, it crashed, it was killed), the ranks waiting for it in
a collective do not hang: the transport notices the closed connection and the collective raises. gloo raises a
plain ``RuntimeError`` ("Connection closed by peer"); NCCL raises ``torch.distributed.DistBackendError``
("remote process exited or there was a network error", "communicator was aborted").

Example::

    try:
        dist.all_reduce(tensor)
    except RuntimeError as error:
        if is_peer_loss(error):
            ...  # the cause is on another rank: say so instead of a traceback that blames this one
"""

from __future__ import annotations

import torch.distributed as dist

PEER_LOSS_MESSAGES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "communicator was aborted",
)
"""Lower-case fragments of the transports' messages for a peer that left (gloo's TCP pair, NCCL)."""


def is_peer_loss(error: BaseException) -> bool:
    """True when ``error`` (or an exception it was raised from) is a collective failing because a peer left."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistBackendError | dist.DistNetworkError):
            return True
        message = str(current).lower()
        if isinstance(current, RuntimeError) and any(fragment in message for fragment in PEER_LOSS_MESSAGES):
            return True
        current = current.__cause__ or current.__context__
    return False
