"""Export a checkpoint's model weights as safetensors, laid out as Hugging Face lays them out.

One ``model.safetensors`` up to ``max_shard_bytes``; above it ``model-00001-of-0000N.safetensors`` files and
a ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), so
``transformers``, ``safetensors.torch.load_file`` and other tools read it as they read any model. Next to
them, ``model_config.json`` holds the LightningModule's ``class_path`` and ``init_args``, so the weights can be
put back into the model they came from.

Example::

    files = write_safetensors(state_dict, Path("export/"), max_shard_bytes=5 * 2**30)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MODEL_CONFIG_FILE = "model_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # Hugging Face's default shard size


def write_safetensors(
    state_dict: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[Path]:
    """Write ``state_dict`` into ``out_dir`` as one safetensors file, or shards plus an index; return the files.

    Every tensor is written under its own name with its own bytes: tensors that share memory (tied
    weights) are each written in full, so what loads back equals the state dict tensor for tensor.
    """
    from safetensors.torch import save_file

    tensors = _standalone(state_dict)
    shards = _shard(tensors, max_shard_bytes)
    out_dir.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        path = out_dir / SINGLE_FILE
        save_file(shards[0], str(path), metadata={"format": "pt"})
        return [path]
    written = []
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        written.append(out_dir / name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*written, out_dir / INDEX_FILE]


def write_model_config(checkpoint: dict[str, Any], config_yaml: Path | None, out_dir: Path) -> Path:
    """``model_config.json``: the model's ``class_path`` and ``init_args``.

    From the hyperparameters Lightning saved (LightningCLI records ``_class_path`` there), else from the
    run's ``config.yaml``; ``class_path`` is null when neither names the class.
    """
    hyper = dict(checkpoint.get("hyper_parameters") or {})
    class_path = hyper.pop("_class_path", None)
    hyper.pop("_instantiator", None)
    init_args: dict[str, Any] = hyper
    if class_path is None and config_yaml is not None and config_yaml.is_file():
        import yaml

        model = (yaml.safe_load(config_yaml.read_text()) or {}).get("model") or {}
        if isinstance(model, dict) and "class_path" in model:
            class_path = model["class_path"]
            init_args = init_args or dict(model.get("init_args") or {})
    path = out_dir / MODEL_CONFIG_FILE
    document = {"class_path": class_path, "init_args": init_args}
    path.write_text(json.dumps(document, indent=2, sort_keys=True, default=str) + "\n")
    return path


def _standalone(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors only, on CPU, contiguous, none sharing memory with another (safetensors refuses shared ones)."""
    seen: set[int] = set()
    tensors = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        tensor = value.detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen and tensor.numel():
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return tensors


def _shard(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split in state-dict order into shards of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards
