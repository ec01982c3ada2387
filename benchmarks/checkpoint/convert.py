"""Checkpoint conversion: time to turn a ZeRO or DCP checkpoint into one file, against a plain copy of its bytes.

    python benchmarks/checkpoint/convert.py [--d-model 512] [--layers 8] [--repeats 3]

A GPT demo (about 25M parameters at the defaults: with AdamW's two moments, 0.3 GB of fp32 state) trains 2 steps
on 2 CPU processes through the real CLI under ZeRO-2, ZeRO-3 and FSDP, each saving at step 2. For each
checkpoint, alternately: ``shutil.copytree`` of its folder with an fsync of every file (the baseline: the same
bytes read and written), and ``convert_to_one_file`` (read every rank's partitions, gather weights and
optimizer state, write one file checksummed and fsynced, copy the RNG files, manifest). The ratio is what a
conversion costs over moving the checkpoint; a resume under another strategy pays it once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import median, publish

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("zero2", "zero3", "fsdp")


def _train(root: Path, strategy: str, d_model: int, layers: int) -> Path:
    run = root / strategy
    command = [
        sys.executable, "-m", "lightning_mlopt", "fit", "--config", str(REPO / "configs" / "gpt.yaml"),
        "--config", str(REPO / "configs" / "strategies" / f"{strategy}.yaml"), "--trainer.accelerator=cpu",
        "--trainer.devices=2", "--trainer.max_steps=3", "--checkpoint.every_n_steps=2",
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", f"--model.init_args.d_model={d_model}",
        f"--model.init_args.n_layer={layers}", f"--run_dir={run}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(command, check=True, cwd=root, env=env, capture_output=True)
    return run / "checkpoints" / "step-000000002"


def _copy(source: Path, destination: Path) -> None:
    shutil.copytree(source, destination)
    for path in destination.rglob("*"):
        if path.is_file():
            with path.open("rb+") as handle:
                os.fsync(handle.fileno())


def _size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from lightning_mlopt.checkpoint.conversion import convert_to_one_file
    from lightning_mlopt.checkpoint.manifest import Manifest
    from lightning_mlopt.strategies import layout_named

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for strategy in SOURCES:
            source = _train(root, strategy, args.d_model, args.layers)
            layout = layout_named(Manifest.from_json((source / "manifest.json").read_text()).layout or "")
            copies, conversions = [], []
            for repeat in range(args.repeats):  # alternately: the machine's drift hits both
                start = time.perf_counter()
                _copy(source, root / f"copy-{strategy}-{repeat}")
                copies.append(time.perf_counter() - start)
                start = time.perf_counter()
                convert_to_one_file(source, root / f"converted-{strategy}-{repeat}", layout)
                conversions.append(time.perf_counter() - start)
                shutil.rmtree(root / f"copy-{strategy}-{repeat}")
            converted_size = _size(root / f"converted-{strategy}-0")
            rows.append(
                f"| {strategy} ({layout.name}) | {_size(source) / 2**20:.0f} | {converted_size / 2**20:.0f} | "
                f"{median(copies):.2f} | {median(conversions):.2f} | {median(conversions) / median(copies):.2f} |"
            )
    body = (
        f"GPT demo, d_model={args.d_model}, {args.layers} layers, 2 CPU processes, checkpoint of step 2; "
        f"median of {args.repeats} alternating repeats.\n\n"
        "| source | checkpoint (MiB) | one file (MiB) | plain copy + fsync (s) | conversion (s) | ratio |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    publish("checkpoint_convert", "cpu-2proc", body)


if __name__ == "__main__":
    main()
