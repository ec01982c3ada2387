"""Why a checkpoint could not be written, in one line a user can act on, agreed by every rank.

Writers fail in many dialects: Python's ``OSError(28, 'No space left on device')``, torch's zip writer's
``unexpected pos 850496 vs 850448`` (a short write on a full disk, errno lost), DCP's ``CheckpointException``
wrapping each rank's failure, DeepSpeed's tracebacks. ``describe_write_error`` finds the operating system's
reason in the chain where there is one, and asks the disk where there is none. ``agree`` and
``first_problem`` make every rank raise the same error, whichever rank failed (a collective all ranks reach).

Example::

    try:
        torch.save(state, path)
    except Exception as error:
        raise CheckpointWriteError(describe_write_error(error, path)) from error
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_mlopt.exceptions import first_line

# Below this much free space, a write failure without an errno is taken to be a full disk.
_NEARLY_FULL_BYTES = 64 * 2**20


def describe_write_error(error: BaseException, path: Path) -> str:
    """``"<reason> (errno N) writing <path>"``: the OS error in the exception chain, else the disk's state.

    Args:
        error: what the writer raised.
        path: the file or folder being written (named in the message; its disk is measured).

    """
    os_error = _find_os_error(error)
    if os_error is not None and os_error.errno is not None:
        # The path we were writing, not the error's filename: a library's temporary file names nothing useful.
        return f"{os.strerror(os_error.errno)} (errno {os_error.errno}) writing {path}"
    if _nearly_full(path):
        return f"{os.strerror(errno.ENOSPC)} (errno {errno.ENOSPC}) writing {path}"
    return f"{type(error).__name__}: {first_line(error, 200)} writing {path}"


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception it carries, breadth first, each once.

    Causes, contexts, exceptions in its ``args``, and the per-rank failures of torch.distributed.checkpoint's
    CheckpointException.
    """
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
        # torch.distributed.checkpoint's CheckpointException keeps {rank: (exception, traceback)} in .failures
        for value in _dcp_failures(current).values():
            candidate = value[0] if isinstance(value, tuple) else value
            if isinstance(candidate, BaseException):
                pending.append(candidate)
        pending += [arg for arg in getattr(current, "args", ()) if isinstance(arg, BaseException)]


def _dcp_failures(error: BaseException) -> dict[Any, Any]:
    failures = getattr(error, "failures", None)
    return failures if isinstance(failures, dict) else {}


def _find_os_error(error: BaseException) -> OSError | None:
    """The first OSError with an errno in ``error``'s chain (see :func:`_chain`)."""
    return next((e for e in _chain(error) if isinstance(e, OSError) and e.errno is not None), None)


def failed_ranks(error: BaseException) -> set[int]:
    """The ranks torch.distributed.checkpoint names as failed (its CheckpointException, on every rank); else empty.

    A DCP save that fails on one rank raises on all of them with the same ``failures``; the ranks whose own
    write succeeded should not report the failure as theirs.
    """
    for current in _chain(error):
        if failures := _dcp_failures(current):
            return {rank for rank in failures if isinstance(rank, int)}
    return set()


def _nearly_full(path: Path) -> bool:
    """True when the disk holding ``path`` (or its nearest existing parent) has almost no space left."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


# ------------------------------------------------------------------ agreeing on a failure


def first_problem(trainer: Any, problem: str | None) -> str | None:
    """Collective over every rank: the first rank's problem (prefixed with its rank), or None if none had one."""
    return agree(problem, trainer.world_size)


def agree(problem: str | None, world_size: int, group: Any = None) -> str | None:
    """:func:`first_problem` over ``group`` (None: the default group); callable from a background thread."""
    return agree_and_gather(problem, None, world_size, group)[0]


def agree_and_gather(
    problem: str | None, payload: Any, world_size: int, group: Any = None
) -> tuple[str | None, list[Any]]:
    """Collective: the first rank's problem or None, and every rank's ``payload``.

    One exchange carries both, e.g. whether each rank's write succeeded and the checksums of what it wrote.
    With several ranks the problem is prefixed with the rank that found it; a single process reports it bare.
    """
    import torch.distributed as dist

    if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return problem, [payload]
    reports: list[Any] = [None] * world_size
    dist.all_gather_object(reports, (problem, payload), group=group)
    first = next((f"rank {rank}: {found}" for rank, (found, _) in enumerate(reports) if found is not None), None)
    return first, [sent for _, sent in reports]


def space_problem(root: Path, needed_bytes: int) -> str | None:
    """A full disk, found before writing: the last checkpoint's size must be free.

    (Retention frees space only after the next commit.)
    """
    if needed_bytes <= 0:
        return None
    free = shutil.disk_usage(root).free
    if free >= needed_bytes:
        return None
    return (
        f"No space left on device: the checkpoint needs about {needed_bytes / 2**20:.1f} MiB and {root} has "
        f"{free / 2**20:.1f} MiB free"
    )
