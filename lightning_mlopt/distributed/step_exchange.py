"""One small all-reduce per training batch that every callback can put named values into.

Callbacks that must agree on something each step (a preemption signal seen on any rank, a timer run out, a
loss mean, a sharded norm) used to pay one collective and one host read each. Here the first callback that
needs results in a batch (:meth:`StepExchange.flush` or :meth:`StepExchange.read`) sums, over every rank,
in one all-reduce and one host read: the values put so far in the batch (:meth:`StepExchange.put`) and the
current values of every registered provider (:meth:`StepExchange.provide`, a function asked at that moment,
so its values are as fresh as they can be whichever callback exchanges first). The others find their values
already there.

Every rank must put the same names with the same sizes and register the same providers; values are summed.
A batch's values are forgotten when the next batch starts.

A reader that can act on values one batch old (:meth:`StepExchange.read_previous`: FaultTolerantCheckpoint's
vote when steps are short) takes the collective off the step's path: at a batch end it reads the sum started
at the previous batch end (long done by then) and starts this batch's in the background. Riders (a monitor's
window) go with it and reach their receivers a batch later; :meth:`StepExchange.settle` delivers what is in
flight (the end of training).

The sum runs on the host, over gloo: training's own group where training runs on gloo (CPU), else (NCCL) a
gloo group of the exchange's own. The values are host values (flags, timers, a window of seconds), so on a GPU
the per-step exchange neither queues behind the step's kernels nor makes the host wait for the device; a
callback that puts device tensors (GradNormMonitor's norms) pays its own copy to the host.

Example::

    exchange = step_exchange(trainer)
    exchange.provide("ftc.signal", lambda: torch.tensor(float(signal_seen())))  # in setup
    ...
    signalled = exchange.read(trainer, "ftc.signal")[0] > 0                    # at the batch's end
    late = exchange.read_previous(trainer, "ftc.signal")  # or: the previous batch end's sum (None at first)
    exchange.settle()                                     # at the end of training: what is in flight arrives
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mlopt.distributed.host_group import host_sum_group, start_host_sum
from lightning_mlopt.distributed.packed import Packed

EXCHANGE_DTYPE = torch.float64
"""Sums on the host in float64: integers (counts, a fingerprint's square) stay exact up to 2**53."""

_EXCHANGES: weakref.WeakKeyDictionary[Any, StepExchange] = weakref.WeakKeyDictionary()


def step_exchange(trainer: Any) -> StepExchange:
    """The trainer's exchange (one per Trainer, shared by its callbacks)."""
    exchange = _EXCHANGES.get(trainer)
    if exchange is None:
        exchange = _EXCHANGES[trainer] = StepExchange()
    return exchange


def _batch_key(trainer: Any) -> int:
    """Which batch the trainer is in: batches started so far in this fit (a public progress counter)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)


class StepExchange:
    """Named values summed over every rank once per batch; see the module docstring.

    Attributes:
        collectives: how many reductions this exchange has issued (for tests and benchmarks).

    """

    def __init__(self) -> None:
        self._batch = -1
        self._pending = Packed()
        self._results: dict[str, list[float]] = {}
        self._providers: dict[str, Callable[[], Tensor]] = {}
        self._receivers: dict[str, Callable[[list[float]], None]] = {}
        self._group: Any = None  # the gloo group of the exchange's own, under NCCL (made at the first exchange)
        self._in_flight: tuple[Any, Tensor, Packed] | None = None  # (work, vector, its slots): read_previous's sum
        self._previous: dict[str, list[float]] | None = None  # that sum, settled, until the next read_previous
        self._sent_in_background: set[str] = set()  # providers this batch's background sum already carries
        self._previous_in_batch: dict[str, list[float]] = {}  # the sum read_previous took in this batch, kept
        self.collectives = 0

    def provide(
        self, name: str, values: Callable[[], Tensor], receive: Callable[[list[float]], None] | None = None
    ) -> None:
        """Register ``values``, called at every batch's exchange for ``name``'s 0-dim or 1-dim tensor.

        ``receive``, if given, is handed the summed values right after the exchange that carried them (when
        the tensor was not empty): a provider that only has something to send now and then, and must not wait
        for a collective of its own, learns the result whichever callback exchanged.
        """
        self._providers[name] = values
        if receive is not None:
            self._receivers[name] = receive

    def withdraw(self, name: str) -> None:
        """Stop exchanging ``name`` (a callback's teardown)."""
        self._providers.pop(name, None)
        self._receivers.pop(name, None)

    def _enter(self, trainer: Any) -> None:
        batch = _batch_key(trainer)
        if batch != self._batch:
            self._batch, self._pending, self._results = batch, Packed(), {}
            self._sent_in_background = set()
            self._previous_in_batch = {}

    def put(self, trainer: Any, name: str, values: Tensor) -> None:
        """Add a 0-dim or 1-dim tensor to this batch's exchange, to be summed over every rank."""
        self._enter(trainer)
        if name in self._results:
            raise RuntimeError(f"step exchange: {name!r} was put after this batch's values were exchanged")
        self._pending.add(name, values)

    def flush(self, trainer: Any, local: Packed | None = None) -> dict[str, list[float]]:
        """Sum everything put so far over every rank (one collective, on the host), and read it and ``local``.

        ``local`` rides along unreduced (values this rank already holds globally), so the caller pays one
        host read for both. Returns the exchanged values put so far in this batch and ``local``'s, by name.
        """
        self._enter(trainer)
        self.settle()  # a background sum first: its riders are delivered in order, its values kept for their reader
        self._ask_providers()
        host = torch.device("cpu")
        reduced = self._pending.tensor(host, EXCHANGE_DTYPE)
        if reduced.numel():
            if self._several(trainer):
                # One all-reduce over the world, which every strategy trains in. Not Strategy.reduce: Lightning's
                # precedes its all-reduce with a barrier, a second collective per call.
                dist.all_reduce(reduced, group=self._host_group())
            self.collectives += 1
        riders = local.tensor(host, EXCHANGE_DTYPE) if local is not None else torch.zeros(0, dtype=EXCHANGE_DTYPE)
        values = torch.cat([reduced, riders]).tolist()
        exchanged = self._pending.unpack(values[: reduced.numel()])
        self._results.update(exchanged)
        self._pending = Packed()
        self._deliver(exchanged)
        if local is not None:
            return {**self._results, **local.unpack(values[reduced.numel() :])}
        return dict(self._results)

    def read_previous(self, trainer: Any, name: str) -> list[float] | None:
        """``name``'s values one batch old, without waiting for a collective; starts this batch's sum.

        If this batch's values of ``name`` were already exchanged (another callback's read), those, fresh. If
        another reader already started this batch's background sum with ``name`` in it, the previous batch's
        values, as that reader got them: readers of one batch never wait for each other's sum. Otherwise the
        sum started by the previous call (its providers asked at the previous batch end),
        waiting only if it is not done; ``None`` if there is none (the first call, or after fresh ones). Then
        every provider not yet exchanged in this batch is asked and summed in the background, to be read by the
        next call (under a recording profiler it is summed before this returns: ``start_host_sum``). Every rank
        must call it at the same batches, as every reader must.
        """
        self._enter(trainer)
        if name in self._results or name in self._pending:  # fresh ones, or values put for a reader: in step
            values = self.read(trainer, name)
            self.settle()
            self._previous = None  # an older sum, superseded by these
            return values
        if name in self._sent_in_background:
            # Another reader started this batch's sum, which carries ``name``: the previous batch's values, kept
            # from that reader's call, without waiting for the sum in flight (it is read at the next batch).
            return self._previous_in_batch.get(name)
        self.settle()
        previous, self._previous = self._previous, None
        self._previous_in_batch = previous or {}
        self._ask_providers()
        slots, self._pending = self._pending, Packed()
        vector = slots.tensor(torch.device("cpu"), EXCHANGE_DTYPE)
        if vector.numel():
            work = start_host_sum(vector, self._host_group()) if self._several(trainer) else None
            self._in_flight = (work, vector, slots)
            self._sent_in_background = {name for name in self._providers if name in slots}
            self.collectives += 1
        return previous.get(name) if previous is not None else None

    def settle(self) -> None:
        """Finish the sum :meth:`read_previous` started, if one is in flight, and hand riders theirs.

        Waits for it if it is not done. Its values stay for the next :meth:`read_previous`. Call it before
        reading a rider's sums at the end of training.
        """
        if self._in_flight is None:
            return
        work, vector, slots = self._in_flight
        self._in_flight = None
        if work is not None:
            work.wait()
        self._previous = slots.unpack(vector.tolist())
        self._deliver(self._previous)

    def _ask_providers(self) -> None:
        for name, provider in self._providers.items():
            if name not in self._results and name not in self._pending and name not in self._sent_in_background:
                self._pending.add(name, provider())

    def _deliver(self, exchanged: dict[str, list[float]]) -> None:
        for name, receive in list(self._receivers.items()):
            if exchanged.get(name):
                receive(exchanged[name])

    @staticmethod
    def _several(trainer: Any) -> bool:
        return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()

    def _host_group(self) -> Any:
        """The group to sum over on the host: None (training's own) on gloo, else a gloo group of its own.

        Made at the first exchange, which every rank reaches in the same batch (making a group is collective).
        """
        if self._group is None:
            self._group = host_sum_group()
        return self._group

    def read(self, trainer: Any, name: str) -> list[float]:
        """The summed values of ``name`` in this batch, exchanging what is pending if they are not there yet."""
        self._enter(trainer)
        if name in self._sent_in_background and name not in self._results:
            self.settle()  # this batch's own values, summed in the background since read_previous
            self._results.update(self._previous or {})
            self._previous = None
        if name not in self._results:
            self.flush(trainer)
        return self._results[name]

    def sum_now(self, trainer: Any, values: Tensor) -> Tensor:
        """Sum ``values`` (host numbers) over every rank at once, outside the per-batch exchange; returns them.

        One all-reduce on the exchange's host group, for what has no training batch to ride in (an evaluation
        batch, an epoch's start). Every rank must call it at the same point.
        """
        if self._several(trainer):
            dist.all_reduce(values, group=self._host_group())
            self.collectives += 1
        return values

    def exchanged(self, trainer: Any, name: str) -> bool:
        """Whether this batch's values of ``name`` have been summed already (a read costs no collective)."""
        self._enter(trainer)
        return name in self._results
