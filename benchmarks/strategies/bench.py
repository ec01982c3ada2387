"""Step time and per-rank state bytes of every strategy on the GPT demo, 2 CPU processes.

    python benchmarks/strategies/bench.py              # 3 repeats, writes benchmarks/results/
    python benchmarks/strategies/bench.py --repeats 1 --steps 30

Each run is a fresh 2-process job through the real Trainer (gloo). Step time is the median after warm-up,
then the median over repeats (strategies interleaved within each repeat), reported as a ratio to DDP. Bytes
are what rank 0 holds after the first optimizer step (lightning_mlopt.distributed.local_state_bytes).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import gpt_step_time, median, publish, run_worker, worker_parser

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload"]


def _worker(name: str, steps: int, warmup: int, out: Path) -> None:
    import lightning.pytorch as pl

    from lightning_mlopt.distributed import local_state_bytes
    from lightning_mlopt.strategies import STRATEGIES as TABLE
    from lightning_mlopt.strategies import FSDPStrategy

    class Bytes(pl.Callback):
        def __init__(self) -> None:
            self.bytes: dict[str, int] = {}

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
            if not self.bytes:  # after the first optimizer step
                self.bytes = asdict(local_state_bytes(pl_module, trainer.optimizers[0]))

    if name == "fsdp":  # the overlay's wrapping: one unit per transformer block
        strategy: object = FSDPStrategy(wrap_classes=["lightning_mlopt.demos.gpt.TransformerBlock"])
    else:
        cls, init_args, _ = TABLE[name]
        strategy = cls(**init_args)
    probe = Bytes()
    step = gpt_step_time(strategy, [probe], steps, warmup)
    if step is not None:
        out.write_text(json.dumps({"median_step_s": step, "bytes": probe.bytes}))


def _mib(value: int) -> str:
    return f"{value / 2**20:.2f}"


def main() -> None:
    parser = worker_parser(__doc__, repeats=3, steps=40, workers=STRATEGIES)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.warmup, args.out)
        return
    times: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    state: dict[str, dict[str, int]] = {}
    for repeat in range(args.repeats):
        order = STRATEGIES if repeat % 2 == 0 else STRATEGIES[::-1]
        for name in order:
            result = run_worker(__file__, name, args.steps, args.warmup)
            times[name].append(result["median_step_s"])
            state[name] = result["bytes"]
            print(f"repeat {repeat} {name}: {result['median_step_s'] * 1e3:.1f} ms/step", flush=True)
    baseline = median(times["ddp"])
    rows = [
        "| strategy | step time (ms) | ratio to DDP | parameters (MiB) | gradients (MiB) | optimizer state (MiB)"
        " | master weights (MiB) | total (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in STRATEGIES:
        step = median(times[name])
        b = state[name]
        total = sum(b.values())
        rows.append(
            f"| {name} | {step * 1e3:.1f} | {step / baseline:.2f} | {_mib(b['parameters'])} | {_mib(b['gradients'])}"
            f" | {_mib(b['optimizer_state'])} | {_mib(b['master_weights'])} | {_mib(total)} |"
        )
    body = (
        "GPT demo (867k parameters: 4 layers, d_model 128, block 64, batch 16 per rank, AdamW, fp32, clip 1.0), "
        f"2 CPU processes (gloo), {args.steps} steps per run, first {args.warmup} excluded, "
        f"median of {args.repeats} interleaved repeats. Bytes: rank 0 after the first optimizer step "
        "(gradients are those still held then: ZeRO frees them in its step).\n\n"
        + "\n".join(rows)
        + "\n\nOn 2 CPU cores communication is cheap and compute is scarce, so sharding's extra collectives "
        "and DeepSpeed's flat-buffer copies show up as overhead; the byte columns are what transfers to GPUs.\n"
    )
    publish("strategies", "cpu-2proc", body)


if __name__ == "__main__":
    main()
