"""The checkpoint's per-step vote without a Trainer: when it is read late, when in step, and what it carries."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest

import lightning_mlopt.checkpoint.step_vote as module
from lightning_mlopt.checkpoint.step_vote import StepVote
from lightning_mlopt.distributed.step_exchange import step_exchange
from lightning_mlopt.process.grace import SaveBudget
from lightning_mlopt.process.signals import preemption


class _TwoRankTrainer(SimpleNamespace):
    """What the vote reads of a Trainer: a batch counter and a world of 2 (no process group: the exchange's
    sums are this process's values, so the mean step time is half this rank's)."""

    def __init__(self) -> None:
        self.progress = SimpleNamespace(total=SimpleNamespace(ready=0))
        super().__init__(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=self.progress)))
        self.world_size = 2

    __hash__ = object.__hash__  # a key of the per-Trainer exchange table, as a Trainer is


@pytest.fixture
def clock(monkeypatch):
    """The vote's clock and this rank's signal, both ours to move."""
    state = SimpleNamespace(now=0.0, signal=None, seconds_left=None)
    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: state.now))
    monkeypatch.setattr(preemption, "received", lambda: state.signal)
    return state


def _saver(failed: bool = False) -> SimpleNamespace:
    return SimpleNamespace(failed=failed, async_save=True, wait=lambda trainer: None)


def _job(clock, every_n_minutes: float | None = None, budget: SaveBudget | None = None) -> Callable[..., object]:
    """A two-rank job's boundaries: each call ends a step of ``step_s`` and returns what the ranks agreed."""
    vote = StepVote(every_n_minutes, _saver(), lambda: budget or SaveBudget(None, None))  # type: ignore[arg-type]
    trainer = _TwoRankTrainer()
    vote.start(trainer, collectives_at_step_start=False)

    def boundary(step_s: float, signal: int | None = None, last_save_step: int = -1):
        trainer.progress.total.ready += 1
        clock.now += step_s
        clock.signal = signal
        agreed = vote.agree(trainer, last_save_step)  # as every rank reads it
        boundary.lagged = vote._lagged  # type: ignore[attr-defined]
        return agreed

    boundary.vote = vote  # type: ignore[attr-defined]
    return boundary


def test_the_vote_is_read_a_boundary_late_with_short_steps_and_in_step_with_long_ones(clock):
    # Real signals to real jobs are the callback's tests; their steps are short: they run the late vote.
    short = _job(clock)
    assert [short(0.1).signalled for _ in range(3)] == [False] * 3 and short.lagged
    assert short(0.1, signal=15).signalled is False  # seen here, summed while the next step trains...
    assert short(0.1, signal=15).signalled is True  # ...and acted on one boundary later, by every rank alike

    long = _job(clock)
    assert [long(0.1).signalled for _ in range(3)] == [False] * 3 and long.lagged
    assert [long(4.0).signalled, long(4.0).signalled] == [False, False] and not long.lagged
    assert long(4.0, signal=15).signalled is True  # now seen and acted on at the same boundary


def test_the_timer_is_due_after_its_minutes_and_a_save_since_resets_it(clock):
    boundary = _job(clock, every_n_minutes=0.5)  # 30 s
    assert [boundary(4.0).due_by_time for _ in range(3)] == [False] * 3 and not boundary.lagged  # long: in step
    assert [boundary(4.0).due_by_time for _ in range(5)] == [False] * 4 + [True]  # 16, 20, 24, 28 s; 32 s
    boundary.vote.saved()
    assert boundary(4.0).due_by_time is False  # 4 s since the save


def test_after_a_signal_the_vote_carries_whether_a_save_still_fits(clock):
    tight = SaveBudget(seconds_left=2.0, save_s=5.0, in_flight_s=1.0)
    boundary = _job(clock, budget=tight)
    agreed = boundary(4.0, signal=15)
    assert agreed.signalled and agreed.no_time and not agreed.no_time_in_flight


def test_nothing_is_exchanged_when_nothing_needs_a_vote(clock):
    saver = SimpleNamespace(failed=False, async_save=False)
    vote = StepVote(None, saver, lambda: SaveBudget(None, None), signals=False)  # type: ignore[arg-type]
    trainer = _TwoRankTrainer()
    vote.start(trainer, collectives_at_step_start=False)
    assert not vote.needed and vote.agree(trainer, -1) == module.Agreed()
    assert step_exchange(trainer).exchanged(trainer, module.KEY) is False
