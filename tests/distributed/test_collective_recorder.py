"""The collective recorder: what it records, what it leaves alone, and the one line it makes of ranks' reports.

In one process, on a gloo group of one: real torch.distributed calls, recorded through the wrappers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_mlopt.distributed.collective_recorder import RECORDED, CollectiveRecorder
from lightning_mlopt.distributed.collective_reports import (
    Record,
    SegmentSummary,
    all_agree,
    describe_reports,
    to_report,
)
from lightning_mlopt.distributed.store_gather import gather_through_store

HERE = "test_collective_recorder.py"


@pytest.fixture
def group(tmp_path) -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def recorder(group) -> Iterator[CollectiveRecorder]:
    recorder = CollectiveRecorder().install()
    try:
        yield recorder
    finally:
        recorder.uninstall()


def test_each_collective_is_recorded_with_its_signature_and_the_callers_line(recorder):
    dist.all_reduce(torch.ones(4))
    line = _line_of("dist.all_gather(")
    dist.all_gather([torch.zeros(2, 3)], torch.ones(2, 3))
    dist.barrier()
    summary = recorder.close_segment(next_step=1)
    assert summary.count == 3 and summary.step == 0
    assert [(r.number, r.call) for r in summary.records] == [
        (1, "all_reduce(float32[4])"),
        (2, "all_gather(1x float32[2, 3])"),
        (3, "barrier()"),
    ]
    assert summary.records[1].site.endswith(f"{HERE}:{line}"), summary.records[1].site
    assert recorder.step == 1 and recorder.count == 0 and recorder.last() is None, "a new segment starts empty"


def test_a_collective_inside_another_is_not_counted_twice(recorder):
    gathered: list[object] = [None]
    dist.all_gather_object(gathered, {"loss": 1.0})  # torch's own all_gathers inside it are its business
    assert [r.call for r in recorder.close_segment(1).records] == ["all_gather_object()"]


def test_other_threads_and_paused_stretches_are_not_recorded(recorder):
    worker = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1)))  # an async checkpoint's, say
    worker.start()
    worker.join()
    with recorder.paused():
        dist.all_reduce(torch.ones(1))
    assert recorder.count == 0


def test_a_sub_groups_collectives_and_a_wrapper_kept_past_uninstall_are_not_recorded(recorder):
    mesh_dimension = dist.new_group([0])  # a TP or HSDP group: issued alike by construction, payloads per group
    dist.all_reduce(torch.ones(3), group=mesh_dimension)
    dist.all_reduce(torch.ones(3), group=dist.group.WORLD)
    assert [r.call for r in recorder.close_segment(1).records] == ["all_reduce(float32[3])"]
    kept = dist.all_reduce  # ``from torch.distributed import all_reduce`` while it was installed
    recorder.uninstall()
    kept(torch.ones(1))
    assert recorder.count == 0
    recorder.install()


def test_the_fingerprint_depends_on_the_order_and_the_signatures(recorder):
    def fingerprint(*shapes: tuple[int, ...]) -> int:
        for shape in shapes:
            dist.all_reduce(torch.ones(shape))
        return recorder.close_segment(1).fingerprint

    assert fingerprint((4,), (2,)) == fingerprint((4,), (2,))
    assert fingerprint((4,), (2,)) != fingerprint((2,), (4,))
    assert fingerprint((4,)) != fingerprint((2, 2)), "the same bytes, another shape"


def test_off_torch_distributed_is_untouched(group):
    originals = {name: getattr(dist, name) for name in RECORDED}
    recorder = CollectiveRecorder().install()
    assert all(getattr(dist, name) is not originals[name] for name in RECORDED)
    with pytest.raises(RuntimeError, match="another CollectiveRecorder is installed"):
        CollectiveRecorder().install()
    recorder.uninstall()
    assert all(getattr(dist, name) is originals[name] for name in RECORDED)


def test_the_sums_tell_whether_every_rank_agreed():
    def sums(*summaries: SegmentSummary) -> list[float]:
        return torch.stack([s.comparable() for s in summaries]).sum(0).tolist()

    same = SegmentSummary(3, 5, 0xABCDE, ())
    assert all_agree(sums(same, same, same), world=3)
    assert not all_agree(sums(same, SegmentSummary(3, 6, 0xABCDE, ()), same), world=3), "one count off"
    # Counts 4, 5, 6: the middle rank's equals the mean, yet the sum of squares tells them apart.
    assert not all_agree(sums(*(SegmentSummary(3, count, 7, ()) for count in (4, 5, 6))), world=3)
    big = SegmentSummary(3, 4000, (1 << 20) - 1, ())
    other = SegmentSummary(3, 4000, (1 << 20) - 2, ())
    assert all_agree(sums(*[big] * 8), world=8) and not all_agree(sums(*[big] * 7, other), world=8)


def _report(step: int, calls: list[tuple[str, str, str]], boundary: bool = False, phase: str = "") -> str:
    records = tuple(Record(index + 1, *call) for index, call in enumerate(calls))
    return to_report(SegmentSummary(step, len(records), 0, records), boundary, phase)


def test_the_line_names_the_first_collective_that_differs_and_each_ranks_call_site():
    shared = ("all_reduce", "float32[1]", "model.py:10")
    reports = {
        0: _report(17, [shared, ("all_gather", "2x float32[4]", "model.py:42")]),
        1: _report(17, [shared], boundary=True),
    }
    assert describe_reports(reports, world=2) == (
        "ranks diverged at collective #2 of step 17: rank 0 all_gather(2x float32[4]) at model.py:42; "
        "rank 1 reached the step boundary"
    )
    hung = {0: _report(4, [("barrier", "", "model.py:7")]), 1: _report(4, [], phase="backward")}
    assert describe_reports(hung, world=2) == (
        "ranks diverged at collective #1 of step 4: rank 0 barrier() at model.py:7; "
        "rank 1 issued no other, now in backward"
    )


def test_the_line_says_when_nothing_diverged_or_a_rank_is_missing():
    same = [("all_reduce", "float32[8]", "train.py:3")]
    assert describe_reports({0: _report(2, same), 1: _report(2, same)}, world=3) == (
        "every rank is in the same collective #1 of step 2: all_reduce(float32[8]) at train.py:3 "
        "(not a divergence: a rank slow or stuck inside it, or the network); rank 2 did not report"
    )
    assert describe_reports({0: _report(2, same), 1: _report(3, [])}, world=2) == (
        "ranks are in different steps: rank 0 in step 2; rank 1 in step 3"
    )


def test_ranks_texts_gather_through_the_store_and_a_missing_rank_only_costs_the_wait():
    store = dist.HashStore()
    results: dict[int, dict[int, str]] = {}

    def rank(number: int) -> None:
        results[number] = gather_through_store(store, "hang/0", number, 3, f"rank {number}", wait_s=0.5)

    threads = [threading.Thread(target=rank, args=(number,)) for number in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert results == {0: {0: "rank 0", 1: "rank 1"}, 1: {0: "rank 0", 1: "rank 1"}}, "rank 2 never came"


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(index for index, line in enumerate(lines, start=1) if text in line and "_line_of" not in line)
