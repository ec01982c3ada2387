"""Which Python objects a checkpoint may create: every pickle in it is checked before anything loads it.

Unpickling runs code: a pickle names callables (``GLOBAL``/``STACK_GLOBAL``) and calls them. Manifest
checksums catch corruption, not a crafted file, so before any library loads a checkpoint (torch, DCP,
DeepSpeed; some of them with ``weights_only=False`` or plain ``pickle.load``), every pickle stream in it is
*dry-run*: Python's own unpickler walks it with each global replaced by an inert stand-in, so the real
stack machine decides which names are referenced, and nothing the file names is ever imported or called.
A name outside :data:`ALLOWED_GLOBALS` (the types lightning_mlopt checkpoints contain) refuses the whole
checkpoint, naming the type and the opt-in.

Pickle streams of a checkpoint: the ``data.pkl`` of every ``torch.save`` archive (one-file checkpoints, RNG
files, DeepSpeed's model and optimizer files, DCP's ``meta.pt``), DCP's ``.metadata``, and each non-tensor
item DCP stores inside its ``.distcp`` shards (found through ``.metadata``, read only after it passed).

Example::

    problems = untrusted_globals(Path("runs/x/checkpoints/step-000000500"))
    if problems:
        raise UntrustedCheckpointError(refusal(path, problems))
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from lightning_mlopt.checkpoint.settings import CHECKPOINT
from lightning_mlopt.exceptions import UntrustedCheckpointError

# What checkpoints written by Lightning and lightning_mlopt contain, by strategy (found by scanning real
# checkpoints of each; see tests/checkpoint/test_checkpoint_trust.py). Constructors of data only: none of them runs
# code named by the file or returns a string a later STACK_GLOBAL could use.
ALLOWED_GLOBALS: frozenset[str] = frozenset(
    {
        # containers and scalars
        "builtins.set",
        "builtins.frozenset",
        "builtins.slice",
        "builtins.complex",
        "builtins.bytearray",
        "collections.OrderedDict",
        "collections.defaultdict",
        "collections.deque",
        "_codecs.encode",  # how protocol-2 pickles store bytes
        "datetime.datetime",
        "datetime.timedelta",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "argparse.Namespace",
        # torch tensors, storages and types
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch._utils._rebuild_sparse_tensor",
        "torch._utils._rebuild_wrapper_subclass",
        "torch._utils._rebuild_device_tensor_from_numpy",
        "torch._utils._rebuild_meta_tensor_no_storage",
        "torch._utils._rebuild_qtensor",
        "torch._tensor._rebuild_from_type_v2",
        "torch.Tensor",
        "torch.nn.parameter.Parameter",
        "torch.Size",
        "torch.device",
        "torch.dtype",
        "torch.float32",
        "torch.float16",
        "torch.bfloat16",
        "torch.float64",
        "torch.int64",
        "torch.int32",
        "torch.uint8",
        "torch.bool",
        "torch.serialization._get_layout",
        "torch.FloatStorage",
        "torch.DoubleStorage",
        "torch.HalfStorage",
        "torch.BFloat16Storage",
        "torch.LongStorage",
        "torch.IntStorage",
        "torch.ByteStorage",
        "torch.BoolStorage",
        "torch.storage.UntypedStorage",
        "torch.UntypedStorage",
        "torch.amp.grad_scaler._MultiDeviceReplicator",
        # NumPy (the RNG state; scalars in logged metrics)
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        "numpy.ndarray",
        "numpy.dtype",
        # what numpy.dtype(...) builds (torch's weights_only loader checks the type it BUILDs)
        "numpy.dtypes.UInt32DType",
        "numpy.dtypes.Int32DType",
        "numpy.dtypes.Int64DType",
        "numpy.dtypes.Float32DType",
        "numpy.dtypes.Float64DType",
        "numpy.dtypes.BoolDType",
        "numpy.random._pickle.__bit_generator_ctor",
        "numpy.random._pickle.__randomstate_ctor",
        # Lightning's own state objects
        "lightning.fabric.utilities.data.AttributeDict",
        "lightning.pytorch.utilities.parsing.AttributeDict",
        # torch.distributed.checkpoint metadata (FSDP)
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.memory_format",
        "torch.strided",
        "torch.contiguous_format",
        "torch.preserve_format",
        # DeepSpeed's checkpoint files
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)


@dataclass(frozen=True)
class Finding:
    """One name a pickle in the checkpoint references that is not allowed (or a pickle that cannot be read)."""

    file: str
    name: str


class _Inert:
    """What every global becomes during a dry run: accepts any construction and mutation, does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def add(self, value: Any) -> None:
        pass


class _DryRun(pickle.Unpickler):
    """Walk a pickle, recording each global it names; every global is replaced by :class:`_Inert`."""

    def __init__(self, stream: io.BufferedIOBase) -> None:
        super().__init__(stream)
        self.names: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        self.names.append(f"{module}.{name}")
        return _Inert

    def persistent_load(self, pid: Any) -> Any:  # torch.save's storages: data, not code
        return None


def globals_in_pickle(data: bytes) -> list[str]:
    """Every global a pickle stream names, in order; raises pickle.UnpicklingError (etc.) on a broken stream."""
    walker = _DryRun(io.BytesIO(data))
    walker.load()
    return walker.names


def _pickles_in_file(path: Path, relative: str) -> Iterator[tuple[str, bytes]]:
    """(label, pickle bytes) of each pickle stream a loader would unpickle from this file."""
    if zipfile.is_zipfile(path):  # torch.save's archive: <name>/data.pkl (+ tensor data, not pickles)
        with path.open("rb") as handle:
            for member, data in _zip_pickles(handle):
                yield f"{relative}:{member}", data
        return
    with path.open("rb") as handle:
        head = handle.read(1)
    # A raw pickle (protocol 2+ starts with PROTO). DCP's .metadata is read with pickle.load whatever it holds.
    if head == b"\x80" or path.name == ".metadata":
        yield relative, path.read_bytes()


def _dcp_byte_items(folder: Path) -> Iterator[tuple[str, bytes]]:
    """The non-tensor items DCP stored inside a folder's .distcp files (read through its checked .metadata)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = _load_checked_metadata(folder / ".metadata")
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        with (folder / info.relative_path).open("rb") as handle:
            handle.seek(info.offset)
            blob = handle.read(info.length)
        label = f"{(folder / info.relative_path).name}:{index.fqn}"
        if zipfile.is_zipfile(io.BytesIO(blob)):
            for _, data in _zip_pickles(io.BytesIO(blob)):
                yield label, data
        else:
            yield label, blob


def _zip_pickles(handle: BinaryIO) -> Iterator[tuple[str, bytes]]:
    """The ``.pkl`` members of a zip archive as torch.save writes it.

    torch stores members uncompressed and may skip their CRC32 (our writes do: the manifest checksums every
    byte), which Python's zipfile would reject; stored members are read straight from their offset.
    """
    with zipfile.ZipFile(handle) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".pkl"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                yield info.filename, archive.read(info)
                continue
            handle.seek(info.header_offset)
            header = handle.read(30)  # the local file header; its name and extra field lengths end it
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            handle.seek(info.header_offset + 30 + name_length + extra_length)
            yield info.filename, handle.read(info.compress_size)


class _Restricted(pickle.Unpickler):
    """A real unpickler that resolves allowed globals only (for DCP's metadata, after its dry run passed)."""

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed")
        return super().find_class(module, name)


def _load_checked_metadata(path: Path) -> Any:
    with path.open("rb") as handle:
        return _Restricted(handle).load()


def untrusted_globals(checkpoint: Path, allowed: frozenset[str] = ALLOWED_GLOBALS) -> list[Finding]:
    """Every name outside ``allowed`` that a pickle in ``checkpoint`` (a file or a folder) references.

    Nothing in the checkpoint is imported or run. A pickle that cannot be walked is reported too (as
    ``<unreadable: ...>``): what cannot be checked is not trusted.
    """
    checkpoint = Path(checkpoint)
    root = checkpoint if checkpoint.is_dir() else checkpoint.parent
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file()) if checkpoint.is_dir() else [checkpoint]
    findings: list[Finding] = []
    metadata_folders = []
    for path in files:
        relative = path.relative_to(root).as_posix()
        if path.suffix in (".json", ".py", ".distcp") or path.name == "latest":
            continue  # text, DeepSpeed's copy of its conversion script (never run by us), DCP shards (below)
        for label, data in _pickles_in_file(path, relative):
            findings.extend(_check(label, data, allowed))
        if path.name == ".metadata":
            metadata_folders.append((path.parent, relative))
    for folder, relative in metadata_folders:
        if any(f.file.startswith(relative) for f in findings):
            continue  # its metadata did not pass: the shards are not read through it
        try:
            for label, data in _dcp_byte_items(folder):
                findings.extend(_check(label, data, allowed))
        except Exception as error:
            findings.append(Finding(relative, f"<unreadable: {error}>"))
    return findings


def _check(label: str, data: bytes, allowed: frozenset[str]) -> list[Finding]:
    try:
        names = globals_in_pickle(data)
    except Exception as error:
        return [Finding(label, f"<unreadable: {type(error).__name__}: {error}>")]
    return [Finding(label, name) for name in dict.fromkeys(names) if name not in allowed]


def refusal(checkpoint: Path, findings: list[Finding]) -> str:
    """The one-paragraph message of a refused checkpoint: the types, where, and the opt-in."""
    shown = ", ".join(f"{f.name} (in {f.file})" for f in findings[:3])
    more = f" and {len(findings) - 3} more" if len(findings) > 3 else ""
    return (
        f"refusing to load {checkpoint}: it references {shown}{more}, outside the types lightning_mlopt "
        "checkpoints contain; unpickling it could run arbitrary code, so nothing in it was loaded. If you trust "
        f"where it came from, set {CHECKPOINT.setting('resume.trust_pickles', True)} (checkpoint tool: --trust-pickles)"
    )


def check_trusted(checkpoint: Path, trust_pickles: bool = False) -> None:
    """Raise :class:`UntrustedCheckpointError` unless every pickle in ``checkpoint`` is allowed (or trusted).

    Example::

        check_trusted(Path("runs/x/checkpoints/step-000000500"))   # before any torch.load / dcp.load
    """
    if trust_pickles:
        return
    findings = untrusted_globals(checkpoint)
    if findings:
        raise UntrustedCheckpointError(refusal(checkpoint, findings))
