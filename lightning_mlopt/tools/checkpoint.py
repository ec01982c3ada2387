"""``python -m lightning_mlopt checkpoint list|verify|consolidate|export|convert``: inspect and convert checkpoints.

``list`` and ``verify`` read manifests and checksums only: they never unpickle anything. ``consolidate``
and ``export`` check every pickle of the checkpoint against the allowlist before loading it
(:mod:`lightning_mlopt.checkpoint.trust`); ``--trust-pickles`` lifts that for a checkpoint you trust. Each
takes a folder or an object-store URL (``s3://bucket/run``, ``s3://bucket/run/step-N``; see
``checkpoint_store.py``); a store that cannot be read ends with one line and exit 74.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from lightning_mlopt.checkpoint.layout import layout_of_folder
from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, Manifest, verify
from lightning_mlopt.checkpoint.remote.object_store import ObjectURL, is_object_url
from lightning_mlopt.checkpoint.store import STATE_NAME, CheckpointStore, refuse_url
from lightning_mlopt.checkpoint.trust import check_trusted
from lightning_mlopt.exceptions import BadInputError, CheckpointInvalidError, ObjectStoreError
from lightning_mlopt.process import exit_codes
from lightning_mlopt.run_dir import CONFIG_NAME
from lightning_mlopt.tools._preamble import ToolArgumentParser, bad_input
from lightning_mlopt.tools.checkpoint_store import LIST_HEADER, list_remote, list_row, local_copy, verify_remote

_EXAMPLE_FOLDER = "runs/<run name>/checkpoints"
_WHAT_TO_NAME = "name a checkpoint file, a step folder or a checkpoints folder (see: checkpoint list)"


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} TiB"


def list_checkpoints(directory: Path) -> int:
    """Print step, time, size and validity of every checkpoint under ``directory``; 0 if any is valid.

    Raises:
        BadInputError: ``directory`` is not a folder.

    """
    if not directory.is_dir():
        said = "is a file" if directory.exists() else "does not exist"
        raise BadInputError(f"{directory} {said}; give a run's checkpoints folder, e.g. {_EXAMPLE_FOLDER}")
    store = CheckpointStore(directory)
    entries = store.entries()
    if not entries:  # a folder, maybe of a run that has not saved yet: nothing valid (1), not bad input
        inside = directory / "checkpoints"
        fix = f"list {inside}" if inside.is_dir() else f"give a run's checkpoints folder, e.g. {_EXAMPLE_FOLDER}"
        print(f"error: no checkpoints in {directory}; {fix}", file=sys.stderr)
        return 1
    latest = store.latest_name()
    print(LIST_HEADER)
    for entry in entries:
        status = "valid" if entry.valid else f"INVALID: {entry.problem}"
        size = _human(_size(entry.path))
        print(list_row(entry.step, entry.manifest, size, status, latest=entry.path.name == latest))
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


def _state_to_read(checkpoint: Path, verb: str) -> Path:
    """The state a command reads: a file or strategy folder as given; our step folders after verifying them.

    ``checkpoint`` may be a checkpoints folder: its newest checkpoint that verifies is taken.
    """
    store = CheckpointStore(checkpoint)
    if not (checkpoint / "manifest.json").exists() and store.committed():
        entry = store.newest_valid()
        if entry is None:
            raise CheckpointInvalidError(f"{checkpoint}: no checkpoint in it verifies (see: checkpoint list)")
        print(f"{verb} the newest valid checkpoint: {entry.path}")
        checkpoint = entry.path
    if (checkpoint / "manifest.json").exists():
        verify(checkpoint)  # before anything in it is unpickled
        return checkpoint / STATE_NAME
    if not checkpoint.exists():
        raise FileNotFoundError(f"no checkpoint at {checkpoint}")
    return checkpoint


def consolidate(checkpoint: Path, output: Path, trust_pickles: bool = False) -> int:
    """Write any checkpoint (one file, FSDP shards, ZeRO partitions) as one Lightning ``.ckpt``."""
    state = _state_to_read(checkpoint, "consolidating")
    if output.exists():
        print(f"error: {output} exists; choose a new path (nothing is overwritten)", file=sys.stderr)
        return 2
    result = load_full_checkpoint(state, trust_pickles)
    result.pop("optimizer_states", None)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, output)
    print(f"wrote {output} ({len(result['state_dict'])} tensors, {_human(output.stat().st_size)})")
    return 0


def export(checkpoint: Path, out_dir: Path, max_shard_bytes: int, trust_pickles: bool = False) -> int:
    """Write any checkpoint's model weights as safetensors (sharded above ``max_shard_bytes``) plus its config."""
    from lightning_mlopt.checkpoint.export import write_model_config, write_safetensors

    if out_dir.exists() and not out_dir.is_dir():
        return bad_input(
            FileExistsError(f"{out_dir} is a file; give a new folder for the export (nothing overwritten)")
        )
    state = _state_to_read(checkpoint, "exporting")
    if out_dir.exists() and any(out_dir.iterdir()):
        print(f"error: {out_dir} is not empty; choose a new folder (nothing is overwritten)", file=sys.stderr)
        return 2
    full = load_full_checkpoint(state, trust_pickles)
    files = write_safetensors(full["state_dict"], out_dir, max_shard_bytes)
    run_config = state.parent.parent.parent / CONFIG_NAME if state.name == STATE_NAME else None
    files.append(write_model_config(full, run_config, out_dir))
    size = sum(path.stat().st_size for path in files)
    names = ", ".join(p.name for p in files) if len(files) <= 3 else f"{len(files) - 2} shards, an index, the config"
    print(f"wrote {len(full['state_dict'])} tensors to {out_dir} ({names}; {_human(size)})")
    return 0


def convert(checkpoint: Path, output: Path, to: str, world_size: int | None, trust_pickles: bool = False) -> int:
    """Write any checkpoint as a step folder that strategy ``to`` resumes at any world size (verified)."""
    from lightning_mlopt.checkpoint.conversion import convert_to_one_file
    from lightning_mlopt.strategies import LAYOUTS, STRATEGIES, layout_named

    if to not in STRATEGIES:
        return bad_input(ValueError(f"--to {to!r}: not one of our strategies ({', '.join(STRATEGIES)})"))
    if output.exists():
        return bad_input(FileExistsError(f"{output} exists; choose a new path (nothing is overwritten)"))
    state = _state_to_read(checkpoint, "converting")
    if state.name != STATE_NAME:
        return bad_input(ValueError(f"{checkpoint}: not a step folder of ours (no manifest); nothing written"))
    check_trusted(state.parent, trust_pickles)
    manifest = Manifest.from_json((state.parent / MANIFEST_NAME).read_bytes())
    layout = layout_named(manifest.layout) if manifest.layout else layout_of_folder(state, LAYOUTS.values())
    output.parent.mkdir(parents=True, exist_ok=True)
    described = convert_to_one_file(state.parent, output, layout, trust_pickles)
    verified = verify(output)
    size = f" for {world_size} process(es)" if world_size else ""
    print(f"wrote {output} ({described}); verified ({len(verified.files)} files)")
    print(f"resume it with --trainer.strategy={to}{size}: --ckpt_path={output}")
    return 0


def load_full_checkpoint(state: Path, trust_pickles: bool = False) -> dict[str, Any]:
    """Any strategy's ``state.ckpt`` (a file, a DCP folder, a DeepSpeed folder) as one full Lightning dict, on CPU.

    Every pickle in it is checked against the allowlist first (raises UntrustedCheckpointError), unless
    ``trust_pickles``; then the strategy that writes its layout consolidates it.

    Raises:
        BadInputError: ``state`` is not a checkpoint: no layout's files, or a file torch.load cannot read.

    """
    from lightning_mlopt.strategies import LAYOUTS, layout_named

    check_trusted(state, trust_pickles)
    manifest = state.parent / MANIFEST_NAME
    recorded = Manifest.from_json(manifest.read_bytes()).layout if manifest.is_file() else None
    try:
        layout = layout_named(recorded) if recorded else layout_of_folder(state, LAYOUTS.values())
    except FileNotFoundError as error:
        inside = state / "checkpoints"  # a run folder, named for its checkpoints
        raise BadInputError(f"{error}; {f'name {inside}' if inside.is_dir() else _WHAT_TO_NAME}") from None
    try:
        return layout.read(state, trust_pickles)
    # What torch.load raises for a file that is no checkpoint (YAML, truncated, empty). Its own advice, to load
    # with weights_only=False, would run whatever the file holds: it is not passed on.
    except (pickle.UnpicklingError, EOFError, RuntimeError, KeyError) as error:
        if not state.is_file():  # a folder in a known layout: the checkpoint's own problem, traceback and all
            raise
        raise BadInputError(
            f"{state}: not a checkpoint torch.load reads with weights_only=True ({type(error).__name__}); "
            f"{_WHAT_TO_NAME}"
        ) from None


def _byte_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` (the memory planner's units) or a byte count, as bytes (argparse type)."""
    from lightning_mlopt.planning.memory import parse_size

    if text.strip().isdigit():
        return int(text)
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive(text: str) -> int:
    """A count of processes (argparse type)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a number of processes >= 1, got {text!r}")
    return int(text)


def _folder(text: str) -> Path:
    """A checkpoint path argument: a file or folder, never a URL (pathlib would take ``s3://b`` for ``s3:/b``)."""
    try:
        refuse_url(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return Path(text)


def _location(text: str) -> Path | str:
    """A checkpoint to read: a file or folder, or an object-store URL (``s3://bucket/run[/step-N]``)."""
    if is_object_url(text):
        try:
            ObjectURL.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text
    return _folder(text)


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m lightning_mlopt checkpoint``; returns the exit status."""
    parser = ToolArgumentParser(prog="python -m lightning_mlopt checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="step, time, size and validity of each checkpoint")
    listing.add_argument("dir", type=_location)
    commands.add_parser("verify", help="check checksums; non-zero exit when invalid").add_argument(
        "path", type=_location
    )
    merge = commands.add_parser("consolidate", help="any checkpoint into one Lightning .ckpt")
    merge.add_argument("checkpoint", type=_location)
    merge.add_argument("output", type=_folder)
    out = commands.add_parser("export", help="any checkpoint's weights as safetensors, with the model's config")
    out.add_argument("checkpoint", type=_location)
    out.add_argument("out_dir", type=_folder)
    out.add_argument("--format", choices=["safetensors"], default="safetensors")
    out.add_argument("--max-shard-size", type=_byte_size, default="5GB", help="shard above this (e.g. 5GB, 500MB)")
    change = commands.add_parser("convert", help="any checkpoint into a step folder another strategy resumes")
    change.add_argument("checkpoint", type=_location)
    change.add_argument("output", type=_folder)
    change.add_argument("--to", required=True, help="the strategy that will resume it (ddp, fsdp, tp, ...)")
    change.add_argument("--world_size", type=_positive, default=None, help="processes that will resume it (any)")
    for loader in (merge, out, change):
        loader.add_argument(
            "--trust-pickles",
            action="store_true",
            help="load a checkpoint that references types outside the allowlist (only one you trust: it can run code)",
        )
    args = parser.parse_args(list(argv))
    try:
        with ExitStack() as stack:
            return _run(args, stack)
    except ObjectStoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return exit_codes.CHECKPOINT_WRITE  # 74, EX_IOERR: the store could not be read
    except BadInputError as error:  # an untrusted checkpoint among them
        return bad_input(error)
    except CheckpointInvalidError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except FileNotFoundError as error:
        return bad_input(error)


def _run(args: argparse.Namespace, stack: ExitStack) -> int:
    if args.command == "list":
        return list_remote(args.dir, _human) if isinstance(args.dir, str) else list_checkpoints(args.dir)
    if args.command == "verify":
        return verify_remote(args.path) if isinstance(args.path, str) else verify_checkpoints(args.path)
    checkpoint = local_copy(args.checkpoint, stack) if isinstance(args.checkpoint, str) else args.checkpoint
    if args.command == "export":
        return export(checkpoint, args.out_dir, args.max_shard_size, args.trust_pickles)
    if args.command == "convert":
        return convert(checkpoint, args.output, args.to, args.world_size, args.trust_pickles)
    return consolidate(checkpoint, args.output, args.trust_pickles)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
