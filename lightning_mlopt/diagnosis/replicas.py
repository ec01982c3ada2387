"""Which replicas disagree: from every rank's fingerprints of the tensors its strategy keeps replicated.

Example::

    >>> # 3 ranks, 1 tensor in replica group 0: rank 2's copy differs from the majority's
    >>> disagreements(["w"], [[0, 11], [0, 11], [0, 99]])
    [Disagreement(name='w', ranks=[2], replicas=[0, 1, 2])]
    >>> describe(disagreements(["w"], [[0, 11], [0, 12]]), step=10)
    'replica mismatch at step 10: w: ranks 0 and 1 disagree (two replicas: either may be the corrupted one)'
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import NamedTuple

SHOWN = 5  # tensors named in a report; the rest are counted


class Disagreement(NamedTuple):
    """A tensor whose replicas are not bit-identical: the ranks that differ, among the replicas holding it."""

    name: str
    ranks: list[int]  # the minority that differs from the majority; with no majority, every replica
    replicas: list[int]


def disagreements(names: Sequence[str], gathered: Sequence[Sequence[int]]) -> list[Disagreement]:
    """Compare fingerprints across ranks; ``gathered[rank]`` is ``[group_1..group_n, hash_1..hash_n]``."""
    count = len(names)
    found = []
    for index, name in enumerate(names):
        groups: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for rank, row in enumerate(gathered):
            groups[row[index]].append((rank, row[count + index]))
        for members in groups.values():
            hashes = Counter(value for _, value in members)
            if len(members) < 2 or len(hashes) == 1:
                continue
            (majority, votes), *_ = hashes.most_common(1)
            has_majority = votes * 2 > len(members)
            ranks = [rank for rank, value in members if not has_majority or value != majority]
            found.append(Disagreement(name, ranks, [rank for rank, _ in members]))
    return found


def describe(found: Sequence[Disagreement], step: int) -> str:
    """One line per disagreeing tensor (the first ``SHOWN``), naming the ranks."""
    lines = []
    for item in found[:SHOWN]:
        others = [rank for rank in item.replicas if rank not in item.ranks]
        if not others and len(item.ranks) == 2:
            lines.append(
                f"{item.name}: ranks {item.ranks[0]} and {item.ranks[1]} disagree "
                "(two replicas: either may be the corrupted one)"
            )
        elif not others:
            lines.append(f"{item.name}: ranks {_ranks(item.ranks)} all disagree (no majority)")
        else:
            lines.append(f"{item.name}: rank {_ranks(item.ranks)} differs from ranks {_ranks(others)}")
    if len(found) > SHOWN:
        lines.append(f"... and {len(found) - SHOWN} more tensors")
    return f"replica mismatch at step {step}: " + "; ".join(lines)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)
