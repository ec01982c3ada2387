"""The per-batch exchange: providers asked at the exchange, one collective per batch, a new batch forgets; read
in step or one batch late (in the background)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_mlopt.distributed.packed import Packed
from lightning_mlopt.distributed.step_exchange import StepExchange
from tests.distributed.two_ranks import on_two_ranks


class _Trainer(SimpleNamespace):
    """What the exchange reads of a Trainer: the batch counter and the world size (no process group here)."""

    def __init__(self) -> None:
        progress = SimpleNamespace(total=SimpleNamespace(ready=0))
        super().__init__(
            fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
            world_size=1,
        )
        self.progress = progress

    __hash__ = object.__hash__  # a key of the per-Trainer exchange table, as a Trainer is


def test_one_collective_carries_puts_providers_and_unreduced_riders():
    trainer, exchange = _Trainer(), StepExchange()
    seen = {"flag": 0.0}
    exchange.provide("vote", lambda: torch.tensor([seen["flag"]]))
    seen["flag"] = 1.0  # a provider is asked at the exchange, not when registered
    exchange.put(trainer, "loss", torch.tensor(1.5))
    local = Packed()
    local.add("norm", torch.tensor(3.0))
    assert exchange.flush(trainer, local) == {"vote": [1.0], "loss": [1.5], "norm": [3.0]}
    assert exchange.read(trainer, "vote") == [1.0]  # already there: no second collective
    assert exchange.collectives == 1
    with pytest.raises(RuntimeError, match="put after this batch's values were exchanged"):
        exchange.put(trainer, "loss", torch.tensor(0.0))

    trainer.progress.total.ready += 1  # the next batch: nothing put yet, the provider asked again
    seen["flag"] = 0.0
    assert exchange.read(trainer, "vote") == [0.0]
    assert exchange.collectives == 2
    exchange.withdraw("vote")
    trainer.progress.total.ready += 1
    assert exchange.flush(trainer) == {}
    assert exchange.collectives == 2  # nothing to exchange: no collective


def test_a_window_rides_another_callbacks_exchange_or_else_goes_to_the_background():
    from lightning_mlopt.distributed.step_exchange import step_exchange
    from lightning_mlopt.perf.window_sum import WindowSum

    trainer = _Trainer()
    exchange = step_exchange(trainer)
    exchange.provide("vote", lambda: torch.tensor([0.0]))  # another callback's per-batch value
    sums = WindowSum(trainer)
    assert sums.arrived() == []  # batch end 1
    sums.submit([1.0, 2.0], step=7)
    exchange.read(trainer, "vote")  # the other callback exchanges after us in the same batch end
    assert exchange.collectives == 1
    trainer.progress.total.ready += 1
    assert sums.arrived() == [([1.0, 2.0], 7)]  # rode along: no collective of its own
    sums.submit([3.0], step=8)
    trainer.progress.total.ready += 1  # a batch in which nobody exchanges
    assert sums.arrived() == []  # taken to the background now...
    trainer.progress.total.ready += 1
    assert sums.arrived() == [([3.0], 8)]  # ...and read a batch later
    sums.submit([4.0], step=9)
    assert sums.drain() == [([4.0], 9)]  # the end of training waits for what is due
    assert exchange.collectives == 1
    sums.close()


def test_a_lagged_reader_gets_the_previous_batchs_sum_and_its_riders_arrive_a_batch_later():
    from lightning_mlopt.distributed.step_exchange import step_exchange
    from lightning_mlopt.perf.window_sum import WindowSum

    trainer = _Trainer()
    exchange = step_exchange(trainer)
    seen = {"flag": 1.0}
    exchange.provide("vote", lambda: torch.tensor([seen["flag"]]))
    sums = WindowSum(trainer)
    sums.submit([5.0], step=3)
    assert exchange.read_previous(trainer, "vote") is None  # nothing started before: this batch's goes out
    assert exchange.collectives == 1
    assert sums.arrived() == []  # taken by the background sum, not moved to a sum of its own

    trainer.progress.total.ready += 1
    seen["flag"] = 0.0
    assert exchange.read_previous(trainer, "vote") == [1.0]  # sampled at the previous batch end
    assert sums.arrived() == [([5.0], 3)]  # rode along, delivered when that sum was read
    assert exchange.collectives == 2

    trainer.progress.total.ready += 1  # another callback reads in step first: fresh values, no second collective
    seen["flag"] = 2.0
    assert exchange.read(trainer, "vote") == [2.0]
    assert exchange.read_previous(trainer, "vote") == [2.0]
    assert exchange.collectives == 3
    trainer.progress.total.ready += 1
    assert exchange.read_previous(trainer, "vote") is None  # the one in flight was superseded by fresh values

    sums.submit([6.0], step=9)
    trainer.progress.total.ready += 1
    exchange.read_previous(trainer, "vote")  # carries the window...
    assert sums.drain() == [([6.0], 9)]  # ...and the end of training settles it
    assert exchange.collectives == 5
    sums.close()


def test_two_lagged_readers_in_one_batch_share_its_background_sum_and_neither_waits_for_it():
    trainer = _Trainer()
    exchange = StepExchange()
    seen = {"vote": 1.0, "count": 10.0}
    for name in seen:
        exchange.provide(name, lambda name=name: torch.tensor([seen[name]]))
    assert exchange.read_previous(trainer, "count") is None  # starts the batch's sum, carrying both
    assert exchange.read_previous(trainer, "vote") is None
    assert exchange.collectives == 1
    trainer.progress.total.ready += 1
    seen.update(vote=2.0, count=20.0)
    assert exchange.read_previous(trainer, "count") == [10.0]  # the previous batch's; this batch's goes out
    waited: list[bool] = []
    exchange.settle = lambda: waited.append(True)  # type: ignore[method-assign]
    assert exchange.read_previous(trainer, "vote") == [1.0], "the previous batch's, as the first reader got them"
    assert waited == [] and exchange.collectives == 2, "the second reader neither waits nor adds a collective"


def _exchange_under_another_backend(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_mlopt.distributed import step_exchange as module

    default_backend = dist.get_backend
    module.dist.get_backend = lambda group=None: "nccl" if group is None else default_backend(group)  # type: ignore[assignment]
    trainer, exchange = _Trainer(), StepExchange()
    trainer.world_size = 2
    exchange.provide("vote", lambda: torch.tensor([float(rank + 1)]))
    first = exchange.read(trainer, "vote")
    group = exchange._group
    trainer.progress.total.ready += 1
    second = exchange.read(trainer, "vote")
    lagged = []
    for _ in range(2):  # in the background, over the same group: the sum started a batch earlier
        trainer.progress.total.ready += 1
        lagged.append(exchange.read_previous(trainer, "vote"))
    exchange.settle()
    record = {"first": first, "second": second, "own_group": group is not None, "same": exchange._group is group}
    record["lagged"] = lagged
    record["backend"] = default_backend(group) if group is not None else None
    return record


@pytest.mark.multiprocess
def test_under_nccl_the_exchange_sums_on_the_host_over_a_gloo_group_of_its_own(tmp_path):
    # Two real processes; training's backend reads as NCCL (no GPU here), so the exchange must make and keep
    # a gloo group of its own and sum the host values there.
    for record in on_two_ranks(_exchange_under_another_backend, tmp_path):
        expected = {"first": [3.0], "second": [3.0], "own_group": True, "same": True, "backend": "gloo"}
        assert record == {**expected, "lagged": [None, [3.0]]}
