"""agree_and_gather in-process: one process reports bare; several agree on the first rank's problem (a fake gather)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from lightning_mlopt.checkpoint.errors import agree, agree_and_gather, first_problem


class _Gather:
    """Stands in for ``dist.all_gather_object``: every rank's report as given, this rank's own at ``rank``."""

    def __init__(self, others: list[tuple[str | None, Any]], rank: int = 0) -> None:
        self.others, self.rank = others, rank
        self.calls: list[tuple[Any, Any]] = []

    def __call__(self, reports: list[Any], sent: Any, group: Any = None) -> None:
        self.calls.append((sent, group))
        assert len(reports) == len(self.others) + 1, "the list must hold one slot per rank"
        reports[:] = [*self.others[: self.rank], sent, *self.others[self.rank :]]


@pytest.fixture
def gather(monkeypatch: pytest.MonkeyPatch):
    """Install a fake exchange behind an initialised default group (nothing real is started)."""

    def install(others: list[tuple[str | None, Any]], rank: int = 0) -> _Gather:
        fake = _Gather(others, rank)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "all_gather_object", fake)
        return fake

    return install


def _no_exchange(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a single process must not reach a collective")


def test_a_single_process_reports_its_problem_bare_without_a_collective(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_gather_object", _no_exchange)
    assert agree_and_gather("No space left on device", {"sha": "ab"}, world_size=1) == (
        "No space left on device",
        [{"sha": "ab"}],
    )
    assert agree_and_gather(None, 7, world_size=1) == (None, [7])


def test_without_a_process_group_several_ranks_are_one_process_s_report(monkeypatch):
    monkeypatch.setattr(dist, "all_gather_object", _no_exchange)
    assert not dist.is_initialized()
    assert agree_and_gather("disk full", "payload", world_size=4) == ("disk full", ["payload"])


def test_when_ranks_disagree_every_rank_gets_the_lowest_failing_rank_s_problem_and_all_payloads(gather):
    fake = gather(
        [(None, "sha-0"), ("Input/output error (errno 5) writing /ckpt/2", "sha-2"), ("late", "sha-3")], rank=1
    )
    problem, payloads = agree_and_gather(None, "sha-1", world_size=4, group="stage-group")
    assert problem == "rank 2: Input/output error (errno 5) writing /ckpt/2"
    assert payloads == ["sha-0", "sha-1", "sha-2", "sha-3"]
    assert fake.calls == [((None, "sha-1"), "stage-group")]  # one exchange carries both, on the group given


def test_rank_zero_s_own_problem_wins_over_later_ranks_and_is_prefixed_with_its_rank(gather):
    gather([("second", 1)], rank=0)
    assert agree_and_gather("first", 0, world_size=2) == ("rank 0: first", [0, 1])


def test_when_no_rank_has_a_problem_the_agreement_is_none_with_every_payload_in_rank_order(gather):
    gather([(None, {"rank": 0}), (None, {"rank": 2})], rank=1)
    assert agree_and_gather(None, {"rank": 1}, world_size=3) == (None, [{"rank": 0}, {"rank": 1}, {"rank": 2}])


def test_an_empty_problem_string_is_still_a_problem(gather):
    gather([("", None)], rank=1)
    assert agree_and_gather(None, None, world_size=2) == ("rank 0: ", [None, None])


def test_agree_and_first_problem_return_only_the_agreed_problem(gather):
    fake = gather([(None, None), ("quota exceeded", None)], rank=0)
    assert agree(None, world_size=3, group="g") == "rank 2: quota exceeded"
    assert first_problem(SimpleNamespace(world_size=3), None) == "rank 2: quota exceeded"
    assert fake.calls == [((None, None), "g"), ((None, None), None)]  # agree sends no payload
    assert first_problem(SimpleNamespace(world_size=1), "alone") == "alone"
