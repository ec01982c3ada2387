"""Read back what W&B wrote offline: the records of a ``run-<id>.wandb`` file.

The file is a LevelDB-style log (a 7-byte ``:W&B`` header, then 32 KiB blocks of chunks, each with a
4-byte checksum, 2-byte length and 1-byte type: full, first, middle, last) of protobuf ``Record``s. The SDK
no longer ships a Python reader, so the tests carry this small one.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7


def _chunks(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", "not a W&B transaction log"
    position, pending = _HEADER, b""
    while position + _HEADER <= len(data):
        if _BLOCK - position % _BLOCK < _HEADER:  # the rest of a block too short for a header is padding
            position += _BLOCK - position % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _HEADER])
        position += _HEADER
        chunk = data[position : position + length]
        position += length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def records(path: Path) -> list[Any]:
    """Every protobuf record of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for raw in _chunks(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        out.append(record)
    return out


def run_file(run_folder: Path) -> Path:
    (found,) = run_folder.glob("run-*.wandb")
    return found


def summary_of(run_folder: Path) -> dict[str, Any]:
    """What a run logged, read back: its id, config (JSON-decoded), history rows, artifacts."""
    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    artifacts: list[dict[str, Any]] = []
    run_id = None
    for record in records(run_file(run_folder)):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            updates = record.run.config.update
        elif kind == "config":
            updates = record.config.update
        else:
            updates = []
        for item in updates:
            config[item.key] = json.loads(item.value_json)
        if kind == "history":
            history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
        if kind == "artifact":
            a = record.artifact
            artifacts.append(
                {
                    "name": a.name,
                    "type": a.type,
                    "aliases": list(a.aliases),
                    "files": [c.path for c in a.manifest.contents],
                }
            )
    return {"id": run_id, "config": config, "history": history, "artifacts": artifacts}
