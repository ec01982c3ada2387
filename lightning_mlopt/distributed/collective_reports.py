"""A step's collective records, how ranks compare them, and the one line made of every rank's report.

A :class:`Record` is one collective; a :class:`SegmentSummary` is a rank's step of them, with a count and a
fingerprint that ranks compare through a sum (:func:`all_agree`).

A rank's report (:func:`to_report`) is its segment of the step (see ``collective_recorder.py``) as JSON: the
step, the count, whether the rank stands at the step boundary, the phase it is in, and the records kept. The
line (:func:`describe_reports`) compares the ranks' sequences call by call and names the first that differs,
with each rank's call site, or says that every rank waits in the same one.

Example::

    reports = gather_through_store(store, prefix, rank, world, to_report(summary, at_boundary=True))
    describe_reports(reports, world)
    # 'ranks diverged at collective #1 of step 2: rank 0 barrier() at model.py:42; rank 1 reached the step boundary'
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


class Record(NamedTuple):
    """One collective: its number in the segment (from 1), op, signature (``float32[4]``) and call site.

    A named tuple: one is made per collective, and a frozen dataclass costs three times as much to make.
    """

    number: int
    op: str
    signature: str
    site: str

    @property
    def call(self) -> str:
        """``all_gather(float32[4])``: what ranks must agree on (the site may differ between them)."""
        return f"{self.op}({self.signature})"


@dataclass(frozen=True)
class SegmentSummary:
    """A closed segment: its step, how many collectives, their fingerprint, and the records kept."""

    step: int
    count: int
    fingerprint: int
    records: tuple[Record, ...]

    def comparable(self) -> torch.Tensor:
        """``[count, count², fingerprint, fingerprint²]`` in float64: summed over ranks, equal iff all agree.

        The ranks' values are all equal exactly when ``n * sum(x²) == sum(x)²`` (their variance is zero).
        """
        count, fingerprint = float(self.count), float(self.fingerprint)
        return torch.tensor([count, count * count, fingerprint, fingerprint * fingerprint], dtype=torch.float64)


def all_agree(summed: list[float], world: int) -> bool:
    """Whether every rank's count and fingerprint were equal, from the sums of :meth:`SegmentSummary.comparable`.

    Example::

        >>> all_agree([6.0, 18.0, 10.0, 50.0], world=2)   # counts 3, 3 and fingerprints 5, 5
        True
        >>> all_agree([7.0, 25.0, 10.0, 50.0], world=2)   # counts 3 and 4
        False
    """
    count, count_squares, fingerprint, fingerprint_squares = summed
    return world * count_squares == count * count and world * fingerprint_squares == fingerprint * fingerprint


def to_report(summary: SegmentSummary, at_boundary: bool, phase: str = "") -> str:
    """One rank's segment as text for the store: JSON with the step, count, records and the step's phase."""
    return json.dumps(
        {
            "step": summary.step,
            "count": summary.count,
            "boundary": at_boundary,
            "phase": phase,
            "records": [[r.op, r.signature, r.site] for r in summary.records],
        }
    )


def describe_reports(reports: dict[int, str], world: int) -> str:
    r"""One line from every rank's report (:func:`to_report`): where the ranks' collectives first differ.

    Example::

        >>> a = to_report(SegmentSummary(17, 1, 0, (Record(1, "all_gather", "float32[4]", "model.py:42"),)), False)
        >>> b = to_report(SegmentSummary(17, 0, 0, ()), True)
        >>> print(describe_reports({1: a, 0: b}, world=2).replace("; ", ";\n"))
        ranks diverged at collective #1 of step 17: rank 1 all_gather(float32[4]) at model.py:42;
        rank 0 reached the step boundary
    """
    parsed = {rank: json.loads(text) for rank, text in reports.items()}
    missing = [rank for rank in range(world) if rank not in parsed]
    gone = f"; rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} did not report" if missing else ""
    if not parsed:
        return "no rank reported its collectives" + gone
    steps = {info["step"] for info in parsed.values()}
    if len(steps) > 1:
        where = "; ".join(f"rank {rank} in step {parsed[rank]['step']}" for rank in sorted(parsed))
        return f"ranks are in different steps: {where}{gone}"
    step = steps.pop()
    sequences = {rank: [(op, signature) for op, signature, _ in info["records"]] for rank, info in parsed.items()}
    longest = max(len(sequence) for sequence in sequences.values())
    for index in range(longest + 1):
        at = {rank: tuple(sequence[index]) if index < len(sequence) else None for rank, sequence in sequences.items()}
        if len(set(at.values())) > 1:
            return f"ranks diverged at collective #{index + 1} of step {step}: {_who(parsed, at, index)}{gone}"
    if all(info["count"] > len(info["records"]) for info in parsed.values()):
        return f"every rank issued the same first {longest} collectives of step {step} (no more were kept){gone}"
    last = {rank: info["records"][-1] if info["records"] else None for rank, info in parsed.items()}
    if not longest:
        return f"no rank is in a recorded collective of step {step}{gone}"
    op, signature, site = next(record for record in last.values() if record is not None)
    return (
        f"every rank is in the same collective #{longest} of step {step}: {op}({signature}) at {site} "
        f"(not a divergence: a rank slow or stuck inside it, or the network){gone}"
    )


def _who(parsed: dict[int, Any], at: dict[int, tuple[str, str] | None], index: int) -> str:
    groups: dict[tuple[str, str] | None, list[int]] = {}
    for rank in sorted(at):
        groups.setdefault(at[rank], []).append(rank)
    parts = []
    for call, ranks in sorted(groups.items(), key=lambda item: -len(item[1]) if item[0] is None else item[1][0]):
        label = f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}"
        if call is None:
            if parsed[ranks[0]]["boundary"]:
                parts.append(f"{label} reached the step boundary")
            else:
                where = sorted({parsed[rank].get("phase") or "?" for rank in ranks})
                parts.append(f"{label} issued no other, now in {'/'.join(where)}")
        else:
            sites = sorted({parsed[rank]["records"][index][2] for rank in ranks})
            parts.append(f"{label} {call[0]}({call[1]}) at {', '.join(sites)}")
    # The ranks that did something unexpected first: a boundary reached is the expected thing.
    return "; ".join(sorted(parts, key=lambda part: "reached" in part or "no other" in part))


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


__all__ = ["Record", "SegmentSummary", "all_agree", "describe_reports", "to_report"]
