"""The fast tier stays fast: a test without a marker that says it is heavy fails when its call takes too long.

The fast tier (``-m "not multiprocess and not slow"``) is what a developer runs after every change; it stays
useful only while it stays under two minutes. A test that launches a process, trains, or starts a server belongs
under ``slow`` (or ``multiprocess``); left unmarked, it would creep into the tier unseen. So
``tests/conftest.py`` fails such a test when its call phase (not its fixtures) takes longer than
:data:`FAST_TEST_LIMIT_S`, naming the marker to add.

Where heavy tests share the machine (a whole-suite run: the other xdist worker may be running a 2-process
fit on the same two cores), wall time stretches for reasons not the test's own, so the limit there is
:data:`CONTENDED_FACTOR` times looser: the guard catches a test that is heavy, not one that was unlucky.

Example::

    >>> over_budget({"parametrize"}, 2.4, "not multiprocess and not slow")
    'an unmarked test took 2.4 s (the fast tier allows 2 s each): mark it @pytest.mark.slow, or make it cheaper'
    >>> over_budget({"slow"}, 30.0, "") is None
    True
"""

from __future__ import annotations

from collections.abc import Iterable

FAST_TEST_LIMIT_S = 2.0
"""Seconds an unmarked test's call may take when the fast tier runs alone."""

CONTENDED_FACTOR = 3.0
"""How much looser the limit is when heavy tests may run beside it (a selection that does not leave them out)."""

HEAVY_MARKERS = frozenset({"slow", "multiprocess", "slurm", "requires_cuda"})
"""Markers that take a test out of the fast tier (``solo`` does not: a timing verdict may still be cheap)."""


def limit_for(markexpr: str) -> float:
    """The limit for this session's selection: strict where ``-m`` leaves both heavy markers out."""
    alone = "not multiprocess" in markexpr and "not slow" in markexpr
    return FAST_TEST_LIMIT_S if alone else FAST_TEST_LIMIT_S * CONTENDED_FACTOR


def over_budget(markers: Iterable[str], seconds: float, markexpr: str) -> str | None:
    """Why a test's call of ``seconds`` breaks the fast tier's budget, or None (heavy-marked, or within it)."""
    if HEAVY_MARKERS & set(markers):
        return None
    limit = limit_for(markexpr)
    if seconds <= limit:
        return None
    return (
        f"an unmarked test took {seconds:.1f} s (the fast tier allows {limit:g} s each): mark it "
        "@pytest.mark.slow, or make it cheaper"
    )
