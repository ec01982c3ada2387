"""What one small host collective adds to a short step: the per-step exchange against Lightning's broadcast.

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/parity/collective_latency.py

FaultTolerantCheckpoint's per-step exchange is one gloo all-reduce of a few numbers (every rank must agree on a
preemption signal, a timer and a failed write at the same step); Lightning's own loop broadcasts one SIGTERM
flag every batch instead (which ours replaces). Each rank does ~1 ms of matrix products (a short step), then
the collective, ``--iterations`` times; the figure is what the collective adds per iteration over the
products alone (best of ``--repeats`` interleaved repeats, rank zero prints). ``all_gather`` is the other
way to agree (gather every rank's flags, sum locally). Prints a table; the parity ablation's notes cite it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slots", type=int, default=5, help="numbers in the exchange (FTC's vote: 5)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    flags = torch.zeros(args.slots)
    gathered = torch.zeros(args.slots * dist.get_world_size())
    flag = torch.zeros(1, dtype=torch.int32)
    matrix = torch.randn(256, 256)
    ops: dict[str, Callable[[], object]] = {
        "compute alone": lambda: None,
        f"all_reduce of {args.slots} floats (our exchange)": lambda: dist.all_reduce(flags),
        "broadcast of 1 int (Lightning's SIGTERM flag)": lambda: dist.broadcast(flag, src=0),
        f"all_gather of {args.slots} floats": lambda: dist.all_gather_into_tensor(gathered, flags),
    }
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, op in ops.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iterations):
                for _ in range(4):
                    matrix @ matrix
                op()
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - start) / args.iterations)
    if dist.get_rank() == 0:
        base = best["compute alone"]
        print(f"| collective ({dist.get_world_size()} processes, gloo) | us per iteration | added over compute |")
        print("|---|---|---|")
        for name, seconds in best.items():
            print(f"| {name} | {seconds * 1e6:.0f} | {(seconds - base) * 1e6:+.0f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
