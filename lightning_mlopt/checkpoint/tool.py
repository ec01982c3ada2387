"""``python -m lightning_mlopt checkpoint list|verify|consolidate``: inspect and convert checkpoints."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_mlopt.checkpoint.manifest import CheckpointInvalidError, verify
from lightning_mlopt.checkpoint.store import STATE_NAME, CheckpointStore


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} TiB"


def list_checkpoints(directory: Path) -> int:
    """Print step, time, size and validity of every checkpoint under ``directory``; 0 if any is valid."""
    store = CheckpointStore(directory)
    entries = store.entries()
    if not entries:
        print(f"no checkpoints in {directory}")
        return 1
    latest = store.latest_name()
    print(f"{'step':>10}  {'saved (UTC)':19}  {'size':>10}  {'reason':13}  status")
    for entry in entries:
        when = "-"
        reason = "-"
        if entry.manifest is not None:
            when = dt.datetime.fromtimestamp(entry.manifest.created, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            reason = entry.manifest.reason + (" (final)" if entry.manifest.final else "")
        status = "valid" if entry.valid else f"INVALID: {entry.problem}"
        marker = "  <- latest" if entry.path.name == latest else ""
        print(f"{entry.step:>10}  {when:19}  {_human(_size(entry.path)):>10}  {reason:13}  {status}{marker}")
    return 0 if any(entry.valid for entry in entries) else 1


def verify_checkpoints(path: Path) -> int:
    """Verify one checkpoint folder, or every one under a checkpoints folder; non-zero if any is invalid."""
    targets = [path] if (path / "manifest.json").exists() else [p for _, p in CheckpointStore(path).committed()]
    if not targets:
        print(f"error: no checkpoint at {path}", file=sys.stderr)
        return 2
    failures = 0
    for target in targets:
        try:
            manifest = verify(target)
            print(f"OK       {target} (step {manifest.step}, {len(manifest.files)} files)")
        except CheckpointInvalidError as error:
            failures += 1
            print(f"INVALID  {target}: {error}")
    return 1 if failures else 0


def consolidate(checkpoint: Path, output: Path) -> int:
    """Write any checkpoint (one file, FSDP shards, ZeRO partitions) as one Lightning ``.ckpt``.

    ``checkpoint`` may be a checkpoints folder: its newest checkpoint that verifies is taken.
    """
    store = CheckpointStore(checkpoint)
    if not (checkpoint / "manifest.json").exists() and store.committed():
        entry = store.newest_valid()
        if entry is None:
            raise CheckpointInvalidError(f"{checkpoint}: no checkpoint in it verifies (see: checkpoint list)")
        print(f"consolidating the newest valid checkpoint: {entry.path}")
        checkpoint = entry.path
    if (checkpoint / "manifest.json").exists():
        verify(checkpoint)  # before anything in it is unpickled
        state = checkpoint / STATE_NAME
    else:
        state = checkpoint
    if output.exists():
        print(f"error: {output} exists; choose a new path (nothing is overwritten)", file=sys.stderr)
        return 2
    result = load_full_checkpoint(state)
    result.pop("optimizer_states", None)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, output)
    print(f"wrote {output} ({len(result['state_dict'])} tensors, {_human(output.stat().st_size)})")
    return 0


def load_full_checkpoint(state: Path) -> dict[str, Any]:
    """Any strategy's ``state.ckpt`` (a file, a DCP folder, a DeepSpeed folder) as one full Lightning dict, on CPU."""
    if state.is_file():
        return torch.load(state, map_location="cpu", weights_only=False)
    if any(state.glob("*.distcp")):  # torch.distributed.checkpoint (FSDP)
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as scratch:
            flat = Path(scratch) / "flat.pt"
            dcp_to_torch_save(state, flat)
            loaded = torch.load(flat, map_location="cpu", weights_only=False)
        meta = state / "meta.pt"
        result = torch.load(meta, map_location="cpu", weights_only=False) if meta.is_file() else {}
        result["state_dict"] = loaded["state_dict"]
        return result
    if (state / "checkpoint").is_dir() or (state / "latest").is_file():  # DeepSpeed
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        with tempfile.TemporaryDirectory() as scratch:
            flat = Path(scratch) / "flat.ckpt"
            convert_zero_checkpoint_to_fp32_state_dict(str(state), str(flat), tag="checkpoint")
            return torch.load(flat, map_location="cpu", weights_only=False)
    raise CheckpointInvalidError(f"{state}: not a checkpoint file, a DCP folder or a DeepSpeed folder")


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m lightning_mlopt checkpoint``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="lightning_mlopt checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="step, time, size and validity of each checkpoint").add_argument("dir", type=Path)
    commands.add_parser("verify", help="check checksums; non-zero exit when invalid").add_argument("path", type=Path)
    merge = commands.add_parser("consolidate", help="any checkpoint into one Lightning .ckpt")
    merge.add_argument("checkpoint", type=Path)
    merge.add_argument("output", type=Path)
    args = parser.parse_args(list(argv))
    try:
        if args.command == "list":
            return list_checkpoints(args.dir)
        if args.command == "verify":
            return verify_checkpoints(args.path)
        return consolidate(args.checkpoint, args.output)
    except CheckpointInvalidError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
