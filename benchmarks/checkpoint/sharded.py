"""Sharded checkpoints: how long a save blocks training, async against sync, FSDP and ZeRO-2 on 2 CPU processes.

    python benchmarks/checkpoint/sharded.py              # ~250 MB of state, 3 saves per run
    python benchmarks/checkpoint/sharded.py --strategies fsdp --layers 2

A model of ``layers`` Linear(width, width) layers with AdamW (parameters + two moments: 12 bytes per
parameter of state) trains through the real Trainer on 2 CPU processes (gloo). Each strategy runs twice in
the same invocation, ``async_save: false`` (the baseline) and ``true``; FaultTolerantCheckpoint's own
``checkpoint/blocking_s`` (the time a save held the training loop) and ``checkpoint/background_s`` (how long
the background write ran until committed) are reported. Goal: async blocking <= 0.10 x sync blocking.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import median, publish, run_worker, worker_parser

MODES = [f"{strategy}-{mode}" for strategy in ("fsdp", "zero2") for mode in ("sync", "async")] + ["fsdp-process"]


def _worker(mode: str, steps: int, out: Path, width: int, layers: int, every: int) -> None:
    import lightning.pytorch as pl
    from bench import loader, wide_model  # the same model and data as the one-file benchmark

    from lightning_mlopt.callbacks import FaultTolerantCheckpoint, Keep, Resume, SaveOn
    from lightning_mlopt.strategies import DeepSpeedStrategy, FSDPStrategy

    name, how = mode.split("-")
    strategy = FSDPStrategy(wrap_classes=["torch.nn.Linear"]) if name == "fsdp" else DeepSpeedStrategy(preset="zero2")
    if how == "process":  # DCP's process-based async checkpointer instead of its thread
        strategy.async_checkpointer = "process"  # type: ignore[union-attr]
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent) as scratch:
        callback = FaultTolerantCheckpoint(
            dirpath=scratch,
            every_n_steps=every,
            async_save=how != "sync",
            save_on=SaveOn(epoch_end=False, train_end=False),
            resume=Resume(auto=False),
            keep=Keep(last=2),
        )
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[callback],
        )
        pl.seed_everything(0, verbose=False)
        trainer.fit(wide_model(width, layers), loader(width))
        callback.saver.wait()
        if trainer.is_global_zero:
            newest = max(Path(scratch).glob("step-*"))
            size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
            timings = callback.saver.save_timings
            # Each save logs the previous background write's seconds; the last one's is the writer's own.
            background = [t.get("checkpoint/background_s", 0.0) for t in timings[1:]]
            background.append(callback.saver.last_background_seconds or 0.0)
            out.write_text(
                json.dumps(
                    {
                        "blocking": [t["checkpoint/blocking_s"] for t in timings],
                        "background": background,
                        "bytes": size,
                    }
                )
            )


def main() -> None:
    parser = worker_parser(__doc__, repeats=1, steps=16, workers=MODES)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--strategies", default="fsdp,zero2")
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.out, args.width, args.layers, args.every)
        return
    rows = []
    summary = []
    for name in args.strategies.split(","):
        results = {}
        for how in ("sync", "async"):
            extra = ["--width", str(args.width), "--layers", str(args.layers), "--every", str(args.every)]
            results[how] = run_worker(__file__, f"{name}-{how}", args.steps, 0, extra)
            print(f"{name} {how}: {results[how]}", flush=True)
        sync_s, async_s = median(results["sync"]["blocking"]), median(results["async"]["blocking"])
        background_s = median(results["async"]["background"])
        mb = results["sync"]["bytes"] / 1e6
        ratio = async_s / sync_s
        rows.append(
            f"| {name} | {mb:.0f} | {sync_s:.2f} | {async_s:.3f} | {background_s:.2f} | **{ratio:.3f}** "
            f"({'met' if ratio <= 0.10 else 'NOT met'}) |"
        )
        summary.append(f"{name} {ratio:.3f}")
    body = (
        f"Model: {args.layers} x Linear({args.width}, {args.width}) with AdamW, 2 CPU processes (gloo), a save "
        f"every {args.every} steps, {args.steps} steps per run; medians over the run's saves.\n\n"
        "| strategy | checkpoint MB | sync save: training blocked (s) | async save: training blocked (s) "
        "| async: background write until committed (s) | async / sync (goal <= 0.10) |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\nFSDP: `torch.distributed.checkpoint.async_save` (thread checkpointer; staging copies each shard to "
        "CPU memory), coordinated over a separate gloo group. ZeRO-2: DeepSpeed's own save with an engine that "
        "keeps DeepSpeed's CPU copies and writes them from a thread (DeepSpeed's Fast/Decoupled engines need its "
        "async-I/O op, which does not build without CUDA). Blocking time includes the dump of the state, the "
        "staging copy, the RNG files and the agreement collectives.\n"
    )
    publish("checkpoint_sharded", "cpu-2proc", body)


if __name__ == "__main__":
    main()
