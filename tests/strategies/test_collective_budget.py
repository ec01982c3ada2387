"""The collective budget of a training step: the strategy's own collectives, our one exchange, nothing else.

Counted in the session's shared runs (the GPT demo through the CLI with its default callbacks, 2 CPU processes,
gloo), by torch.profiler, each collective attributed to who asked for it
(``lightning_mlopt.diagnosis.collectives``). Off logging steps a batch may carry:

- the strategy's own collectives, exactly as many as a hand-written loop with the library alone issues for the
  same model and settings (``benchmarks/parity/hand_loop.py --count-collectives``; the table below);
- one all-reduce of ours: the per-step exchange every callback shares (preemption, timers), in step or started
  in the background and read a batch later;
- none from Lightning's loops (2.6 broadcast a SIGTERM flag every batch; skipped where our handler owns SIGTERM).

The hand loop's counts were measured with torch 2.13 and DeepSpeed 0.19 on this model; a version that changes
the library's own collectives changes them, and this test says so rather than passing on a new number.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import COUNTED_STEPS

# Per batch, what the library alone issues (hand_loop.py --count-collectives, clip active; the same on every warm step):
HAND_WRITTEN_LOOP = {
    "ddp": 1,  # one gradient bucket all-reduce
    "fsdp": 16,  # 5 units x (forward all-gather + backward all-gather + reduce-scatter), + the clip norm
    "zero1": 5,  # the gradient all-reduce, the clip norm (2), the updated partitions' all-gathers (2)
    "zero2": 5,  # the same as ZeRO-1 on this model (one reduce bucket)
    "zero3": 56,  # 53 parameter all-gathers (with prefetch), 1 reduce-scatter, the clip norm (2)
}
# The exchange sums in step, or (FaultTolerantCheckpoint's vote with short steps, as here) in the background,
# through start_host_sum.
EXCHANGE_SITES = {
    "lightning_mlopt/distributed/step_exchange.py:flush allreduce",
    "lightning_mlopt/distributed/host_group.py:start_host_sum allreduce",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", sorted(HAND_WRITTEN_LOOP))
def test_a_training_step_issues_the_strategys_collectives_and_our_one_exchange(strategy, strategy_runs):
    run = strategy_runs[strategy]
    out = run.run_dir.parents[1] / strategy
    for rank in (0, 1):
        counted = json.loads((out / f"collectives-rank{rank}.json").read_text())
        every = counted["log_every_n_steps"]
        batches = [b for b in counted["batches"] if (b["step"] + 1) % every != 0]  # off logging steps
        assert [b["step"] for b in batches] == [s for s in range(*COUNTED_STEPS) if (s + 1) % every != 0]
        assert batches, f"no batch counted off a logging step: COUNTED_STEPS {COUNTED_STEPS}, every {every}"
        for batch in batches:
            where = f"{strategy}, rank {rank}, step {batch['step']}: {batch['sites']}"
            issued = batch["by_issuer"]
            assert issued.get("lightning", 0) == 0, f"Lightning's loop issued a collective: {where}"
            assert issued.get("other", 0) == 0, where
            ours = batch["sites"].get("lightning_mlopt", {})
            assert sum(ours.values()) == 1 and set(ours) <= EXCHANGE_SITES, where
            assert issued.get("strategy", 0) == HAND_WRITTEN_LOOP[strategy], where
