"""Full checkpoints and DTensor strategies: a DCP folder read whole, and one full file loaded into sharded modules.

Both directions of a conversion between a sharded layout and one file (``checkpoint/conversion.py``):
``consolidate_dcp`` gathers a DCP folder (FSDP, TP, 2D) into one Lightning dict, weights and optimizer state
named per parameter; ``load_full_file`` loads such a dict, or a DDP file whose optimizer state is numbered,
into modules whose parameters are DTensors, each rank keeping its own shards.

Lightning's ModelParallelStrategy loads a full file too, but matches a numbered optimizer state to the
*module's* parameter order; an optimizer whose groups follow another order (decayed weights first, then
biases) gets each moment on the wrong parameter, or a shape error. Here the order is the optimizer's own.

Example::

    full = consolidate_dcp(Path("runs/x/checkpoints/step-000000500/state.ckpt"))
    rest = load_full_file(model, optimizers, Path("converted/state.ckpt"), strict=True, trust_pickles=False)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_mlopt._compat import read_dcp_whole
from lightning_mlopt.checkpoint.layout import DCP_META_NAME
from lightning_mlopt.checkpoint.optimizer_keys import (
    group_names,
    is_flattened,
    is_keyed_by_name,
    keyed_by_name,
    restricted_to,
    unflattened,
)
from lightning_mlopt.checkpoint.serialization import load_file
from lightning_mlopt.exceptions import BadInputError

_OPTIMIZER_PREFIX = "optimizer_"  # DCP keys of the optimizers' states next to "state_dict"


def consolidate_dcp(state: Path, trust_pickles: bool = False) -> dict[str, Any]:
    """A DCP folder as one full Lightning dict on CPU: weights, optimizer states named per parameter, the rest.

    The non-tensor state (loops, schedulers, callbacks) comes from ``meta.pt`` beside the shards.
    """
    loaded = read_dcp_whole(state)  # its pickles passed the allowlist first (check_trusted), as for any load
    meta = state / DCP_META_NAME
    result = load_file(meta, trust_pickles) if meta.is_file() else {}
    result["state_dict"] = loaded["state_dict"]
    optimizers = sorted(
        (int(key[len(_OPTIMIZER_PREFIX) :]), value)
        for key, value in loaded.items()
        if key.startswith(_OPTIMIZER_PREFIX) and key[len(_OPTIMIZER_PREFIX) :].isdigit()
    )
    if optimizers:
        # A pipeline-parallel run writes torch's flattened form (its stages' group lists would collide).
        result["optimizer_states"] = [unflattened(value) if is_flattened(value) else value for _, value in optimizers]
    return result


def load_full_file(
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    path: Path,
    strict: bool,
    trust_pickles: bool,
    stage_only: bool = False,
) -> dict[str, Any]:
    """Load a full checkpoint file into a module of DTensors and its optimizers; returns the rest of the dict.

    Every rank maps the file (memory-mapped: ranks on one machine share its pages) and keeps its own shards.
    The optimizer states may be numbered (DDP's) or named (a conversion's). ``stage_only``: ``module`` holds a
    pipeline stage, and takes its own parameters' part of the whole model's file.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    checkpoint = load_file(path, trust_pickles, mmap=True)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    weights = checkpoint.pop("state_dict")
    if stage_only:
        own = module.state_dict().keys()
        weights = {name: value for name, value in weights.items() if name in own}
    set_model_state_dict(module, weights, options=options)
    for optimizer, saved in zip(optimizers, checkpoint.get("optimizer_states") or [], strict=False):
        live = group_names(optimizer, module)
        saved = unflattened(saved) if is_flattened(saved) else saved
        if stage_only and not is_keyed_by_name(saved):
            raise BadInputError(
                f"{path}: its optimizer state numbers the parameters (DDP's, one device's), which only the whole "
                "model's optimizer can read; a pipeline stage holds part of it. Resume it under ddp or fsdp for a "
                "step first (their checkpoints name every parameter), then under pp"
            )
        named = keyed_by_name(saved, live)
        if stage_only:
            named = restricted_to(named, live)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=named, options=options)
    return checkpoint


def saved_flattened(path: Path) -> bool:
    """Whether a DCP folder's optimizer states are torch's flattened form (a pipeline-parallel run's)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    grouped = [key for key in keys if key.startswith(_OPTIMIZER_PREFIX) and ".param_groups." in key]
    return bool(grouped) and not any(key.split(".")[2].isdigit() for key in grouped)


def load_dcp_folder(
    module: nn.Module, optimizers: Sequence[Optimizer], path: Path, strict: bool, trust_pickles: bool
) -> dict[str, Any]:
    """Load a DCP folder into ``module`` (plain tensors or DTensors) and its optimizers; returns ``meta.pt``'s dict.

    Each rank reads what it holds: its shards, or its pipeline stages' parameters out of a checkpoint that has
    every stage's (the names are the whole model's). Optimizer states in either form, nested or flattened; a
    nested one keeps the live groups' parameter lists (a checkpoint written at another layout lists others).
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    weights = {"state_dict": get_model_state_dict(module)}
    load(weights, checkpoint_id=path)
    set_model_state_dict(module, weights["state_dict"], options=StateDictOptions(strict=strict))
    options = StateDictOptions(flatten_optimizer_state_dict=saved_flattened(path))
    for index, optimizer in enumerate(optimizers):
        key = f"{_OPTIMIZER_PREFIX}{index}"
        target: dict[str, Any] = dict(get_optimizer_state_dict(module, optimizer, options=options))
        live_params = [list(group["params"]) for group in target.get("param_groups", [])]
        state = {key: target}
        load(state, checkpoint_id=path)
        for group, params in zip(state[key].get("param_groups", []), live_params, strict=False):
            group["params"] = params
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state[key], options=options)
    meta = path / DCP_META_NAME
    return load_file(meta, trust_pickles) if meta.is_file() else {}
