"""Lightning's own strategy on the GPT demo, as a user of plain Lightning runs it: the second parity baseline.

    python benchmarks/parity/lightning_loop.py --strategy ddp --steps 60

``configs/gpt.yaml``'s model, data and Trainer settings in a plain ``lightning.pytorch.Trainer`` (Lightning's
own defaults for the rest: its ``ModelCheckpoint``, no progress bar as in a batch job), with Lightning's
``ddp`` or ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` per block and on the model in
``configure_model``, as Lightning's docs show). Lightning's ``DeepSpeedStrategy`` is not run: it refuses a
CPU accelerator ("DeepSpeed strategy is only supported on GPU").

``--with checkpoint|performance|goodput`` (repeatable) adds one of our default callbacks, with the CLI's
defaults (``FaultTolerantCheckpoint``, ``PerformanceMonitor``, ``GoodputLedger``), to the plain Trainer: the
parity benchmark's ``--ablation`` times each one alone against Lightning's own run.

``--our-strategy`` runs our strategy instead (``configs/strategies/<strategy>.yaml``'s class and settings, ZeRO
too) in the same plain Trainer, with no callback of ours: Lightning's loop around the library as our strategy
drives it, the part of our step time that a Lightning plugin cannot remove (the parity table's "loop" arm).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hand_loop import REPO, STRATEGIES, load_config
from step_clock import StepClock


def _fully_sharded(model_args: dict[str, Any]) -> Any:
    from lightning_mlopt.demos import GPTLanguageModel

    class FullyShardedGPT(GPTLanguageModel):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.layers:  # the same units as our overlay's wrap_classes
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return FullyShardedGPT(**model_args)


def _our_strategy(name: str) -> Any:
    """Our strategy as ``configs/strategies/<name>.yaml`` configures it (its class_path and init_args)."""
    import yaml

    from lightning_mlopt.planning.probe import instantiate

    overlay = yaml.safe_load((REPO / "configs" / "strategies" / f"{name}.yaml").read_text())
    return instantiate(overlay["trainer"]["strategy"])


def _our_callbacks(names: list[str], root: str) -> list[Any]:
    """Our default callbacks named in ``names``, made as the CLI makes them (its defaults)."""
    from lightning_mlopt.callbacks import FaultTolerantCheckpoint, PerformanceMonitor
    from lightning_mlopt.goodput.ledger import GoodputLedger

    made = {
        "checkpoint": lambda: FaultTolerantCheckpoint(),
        "performance": lambda: PerformanceMonitor(),
        "goodput": lambda: GoodputLedger(path=str(Path(root) / "goodput.jsonl")),
    }
    return [made[name]() for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument(
        "--our-strategy", action="store_true",
        help="our strategy (configs/strategies/<strategy>.yaml) instead of Lightning's, no callback of ours",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--root", default=None, help="Lightning's default_root_dir (default: a temporary one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--step-times", default=None, help="rank 0 writes each step's seconds here (StepClock)")
    parser.add_argument(
        "--with", dest="ours", action="append", default=[], choices=["checkpoint", "performance", "goodput"],
        help="add one of our default callbacks (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--trace", default=None, metavar="START,STOP,FILE",
        help="rank 0 profiles steps START..STOP-1 into FILE (trace_window.py)",
    )  # fmt: skip
    args = parser.parse_args()
    if not args.our_strategy and args.strategy not in ("ddp", "fsdp"):
        parser.error(f"Lightning's DeepSpeedStrategy refuses a CPU: {args.strategy} runs only with --our-strategy")

    import lightning.pytorch as pl

    from lightning_mlopt.demos import GPTLanguageModel, TokenDataModule

    config = load_config(args.set)
    pl.seed_everything(int(config["seed_everything"]), verbose=False)
    settings = {key: value for key, value in config["trainer"].items() if key not in ("accelerator", "devices")}
    settings["max_steps"] = args.steps
    fsdp = args.strategy == "fsdp" and not args.our_strategy  # ours shards by its wrap_classes
    if args.our_strategy:
        strategy = _our_strategy(args.strategy)
    else:
        strategy = pl.strategies.ModelParallelStrategy() if fsdp else "ddp"
    root = args.root or tempfile.mkdtemp(prefix="lightning_parity_")
    callbacks: list[Any] = [StepClock(args.step_times)] if args.step_times else []
    if args.trace:
        from trace_window import TraceSteps

        start, stop, out = args.trace.split(",", 2)
        callbacks.append(TraceSteps(int(start), int(stop), out))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, *_our_callbacks(args.ours, root)],
        **settings,
    )
    model_args = config["model"]["init_args"]
    model = _fully_sharded(model_args) if fsdp else GPTLanguageModel(**model_args)
    trainer.fit(model, TokenDataModule(**config["data"]["init_args"]))


if __name__ == "__main__":
    main()
