"""ZeRO checkpoints and full state: a ZeRO folder (any stage, any world size) read whole, a full state loaded into ZeRO.

DeepSpeed's own ``zero_to_fp32`` gathers the fp32 master weights from the ranks' flat partitions and drops the
optimizer; its universal checkpoint keeps the optimizer but only DeepSpeed reads it. Here the optimizer's
per-partition state (Adam's ``exp_avg`` and ``exp_avg_sq``, or any other per-element state) is gathered the
way the weights are: each rank's flat partition of a parameter group holds the same elements of the moments
as of the weights, so the one layout gives both. The result names each parameter as the LightningModule does
(``optimizer_keys.py``), so any strategy loads it into its own optimizer, whatever its world size.

Layout read (DeepSpeed 0.10 and later, as Lightning saves it under the tag ``checkpoint``):

- stages 1 and 2: ``mp_rank_00_model_states.pt`` (buffers, ``param_shapes`` per group, Lightning's own state)
  and one ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank: per group, a contiguous slice of the
  concatenated parameters (``single_partition_of_fp32_groups``, alignment padding after each parameter);
- stage 3: per rank a ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` and an optimizer file; every parameter is
  split into ``ceil(numel / world)`` elements per rank (``fp32_flat_groups``).

Example::

    full = read_zero_checkpoint(Path("runs/x/checkpoints/step-000000500/state.ckpt"))
    full["optimizer_states"][0]["state"]["model.lm_head.weight"]["exp_avg"].shape   # the full tensor
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_mlopt._compat import link_zero_optimizer_state, restore_zero_state, zero_optimizer_parts
from lightning_mlopt.checkpoint.optimizer_keys import keyed_by_name
from lightning_mlopt.checkpoint.serialization import load_file
from lightning_mlopt.exceptions import BadInputError, CheckpointInvalidError, said_by_rank_zero

# What DeepSpeed itself keeps in the model-states file (Lightning's own state is everything else).
_DEEPSPEED_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
        "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
        "csr_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
        "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
    }
)  # fmt: skip
TAG = "checkpoint"  # the tag Lightning's DeepSpeedStrategy saves under


def read_zero_checkpoint(state: Path) -> dict[str, Any]:
    """The ZeRO checkpoint folder ``state`` as one full Lightning dict on CPU, with ``optimizer_states``.

    Call it once every pickle in the folder passed the allowlist (``checkpoint/trust.py``): DeepSpeed's files
    hold its own types, so they are loaded with ``weights_only=False``.

    Raises:
        CheckpointInvalidError: a rank's file is missing, or the layout is not one this reads.

    """
    folder = _tag_folder(state)
    optimizer_files = _by_rank(folder.glob("*_optim_states.pt"))
    shards = [_load(path)["optimizer_state_dict"] for path in optimizer_files]
    if not shards:
        raise CheckpointInvalidError(f"{folder}: no *_optim_states.pt: not a ZeRO checkpoint")
    stage = int(shards[0]["zero_stage"])
    world = _partition_count(shards[0])
    if len(shards) != world:
        raise CheckpointInvalidError(f"{folder}: {len(shards)} optimizer files for a world of {world} ranks")
    model_files = _by_rank(folder.glob("*_model_states.pt"))
    models = [_load(path) for path in (model_files if stage == 3 else model_files[:1])]
    shapes: list[Mapping[str, torch.Size]] = models[0]["param_shapes"]
    base = [shard["optimizer_state_dict" if stage == 3 else "base_optimizer_state"] for shard in shards]
    merge = _merge_stage3 if stage == 3 else _merge_stage12
    fp32 = [shard["fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"] for shard in shards]
    paddings = shards[0].get("param_alignment_paddings")
    weights = merge(fp32, shapes, world, paddings)
    # Stages 1 and 2 keep every weight whole in the model file too (16-bit under mixed precision): the frozen
    # ones come from there (ZeRO-1 saves no fragments of them); the trained ones from the fp32 partitions.
    whole = {} if stage == 3 else {k: v for k, v in models[0]["module"].items() if k not in weights}
    state_dict = whole | _buffers(models[0]) | _frozen(models, stage) | weights
    for alias, source in models[0].get("shared_params", {}).items():
        state_dict[alias] = state_dict[source]
    full = {key: value for key, value in models[0].items() if key not in _DEEPSPEED_KEYS}
    full["state_dict"] = {_without_prefix(name): tensor for name, tensor in state_dict.items()}
    full["optimizer_states"] = [_optimizer_by_name(base, shapes, world, paddings, merge)]
    return full


def loads_as_it_is_under_zero(state: Path, saved_world_size: int, world_size: int, stage: int) -> bool:
    """Whether DeepSpeed loads the ZeRO folder ``state`` as it is: the same world size, and the same file family.

    Stage 3 names its files per rank (``zero_pp_rank_<r>_mp_rank_00_model_states.pt``), stages 1 and 2 keep one
    ``mp_rank_00_model_states.pt`` (and read each other's); across that line, or at another world size, the
    checkpoint is converted.
    """
    try:
        folder = _tag_folder(state)
    except CheckpointInvalidError:
        return True  # not a ZeRO folder DeepSpeed could read either: its own load says why
    saved_stage3 = any(folder.glob("zero_pp_rank_*_model_states.pt"))
    return saved_world_size == world_size and saved_stage3 == (stage == 3)


def _optimizer_by_name(
    base: Sequence[Mapping[str, Any]], shapes: Sequence[Mapping[str, torch.Size]], world: int, paddings: Any, merge: Any
) -> dict[str, Any]:
    """The base optimizer's state, gathered per parameter and keyed by name; its groups' settings kept.

    The base optimizer steps one flat partition per sub-group (``shapes`` holds each one's parameters, in
    order); each of its groups lists its sub-groups (one per group in stages 1 and 2, several in stage 3 when
    ``sub_group_size`` splits a group).
    """
    per_partition = base[0]["state"]
    if per_partition and sorted(per_partition) != list(range(len(shapes))):
        raise CheckpointInvalidError(f"optimizer state for partitions {sorted(per_partition)} of {len(shapes)}")
    first = per_partition.get(0) or {}
    per_element = sorted(k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() == 1 and k != "step")
    gathered = {
        key: merge([[rank["state"][i][key] for i in range(len(shapes))] for rank in base], shapes, world, paddings)
        for key in per_element
    }
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for settings in base[0]["param_groups"]:
        names = []
        for partition in settings["params"]:
            scalars = {k: v for k, v in (per_partition.get(partition) or {}).items() if k not in per_element}
            for name in shapes[partition]:
                names.append(_without_prefix(name))
                if per_partition:
                    state[names[-1]] = {k: _copy(v) for k, v in scalars.items()} | {
                        key: gathered[key][name] for key in per_element
                    }
        groups.append({**settings, "params": names})
    return {"state": state, "param_groups": groups}


def _merge_stage12(
    partitions: Sequence[Sequence[torch.Tensor]], shapes: Sequence[Mapping[str, torch.Size]], world: int, paddings: Any
) -> dict[str, torch.Tensor]:
    """Stages 1 and 2: per group, the ranks' slices concatenated hold the parameters one after another."""
    full: dict[str, torch.Tensor] = {}
    for group, names in enumerate(shapes):
        flat = torch.cat([rank[group].detach().reshape(-1) for rank in partitions])
        offset = 0
        for position, (name, shape) in enumerate(names.items()):
            numel = math.prod(shape)
            full[name] = flat.narrow(0, offset, numel).view(shape)  # a view: the group's flat is saved once
            offset += numel + (paddings[group][position] if paddings is not None else 0)
        if offset > flat.numel():
            raise CheckpointInvalidError(f"group {group}: the partitions hold {flat.numel()} elements, not {offset}")
    return full


def _merge_stage3(
    partitions: Sequence[Sequence[torch.Tensor]], shapes: Sequence[Mapping[str, torch.Size]], world: int, _: Any
) -> dict[str, torch.Tensor]:
    """Stage 3: each parameter is split evenly over the ranks (padded), one after another in every rank's flat."""
    flats = [torch.cat([tensor.detach().reshape(-1) for tensor in rank]) for rank in partitions]
    full: dict[str, torch.Tensor] = {}
    offset = 0
    for names in shapes:
        for name, shape in names.items():
            numel = math.prod(shape)
            per_rank = math.ceil(numel / world)
            pieces = [flat.narrow(0, offset, per_rank) for flat in flats]
            full[name] = torch.cat(pieces)[:numel].view(shape)
            offset += per_rank
    if offset > flats[0].numel():
        raise CheckpointInvalidError(f"the partitions hold {flats[0].numel()} elements per rank, not {offset}")
    return full


def _buffers(model: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    names = set(model.get("buffer_names") or [])
    return {name: value for name, value in model["module"].items() if name in names}


def _frozen(models: Sequence[Mapping[str, Any]], stage: int) -> dict[str, torch.Tensor]:
    """Parameters without gradients: whole in the model file (stages 1, 2), split over the ranks' files (3)."""
    shapes = models[0].get("frozen_param_shapes") or {}
    if stage != 3:
        return dict(models[0].get("frozen_param_fragments") or {})
    frozen = {}
    for name, shape in shapes.items():
        pieces = [model["frozen_param_fragments"][name].reshape(-1) for model in models]
        frozen[name] = torch.cat(pieces)[: math.prod(shape)].view(shape)
    return frozen


def _tag_folder(state: Path) -> Path:
    latest = state / "latest"
    tag = latest.read_text().strip() if latest.is_file() else TAG
    folder = state / tag
    if not folder.is_dir():
        raise CheckpointInvalidError(f"{state}: no DeepSpeed tag folder {tag!r}")
    return folder


def _by_rank(paths: Any) -> list[Path]:
    """Files ordered by the rank in their name (``zero_pp_rank_10`` after ``zero_pp_rank_9``)."""

    def rank(path: Path) -> int:
        found = re.search(r"rank_(\d+)_", path.name)
        return int(found.group(1)) if found else 0

    return sorted(paths, key=rank)


def _partition_count(shard: Mapping[str, Any]) -> int:
    count = shard["partition_count"]
    return max(count) if isinstance(count, (list, tuple)) else int(count)


def _load(path: Path) -> Any:
    # Every pickle in the checkpoint passed the allowlist before this (see read_zero_checkpoint). Memory-mapped:
    # a tensor's bytes are read when gathered, once, and the module's weights DeepSpeed keeps beside the
    # partitions (not needed: the partitions hold them in fp32) are never read.
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def _without_prefix(name: str) -> str:
    """Lightning < 2.1 saved the module under ``_forward_module.``; names are the LightningModule's."""
    prefix = "_forward_module."
    return name[len(prefix) :] if name.startswith(prefix) else name


def load_full_file(strategy: Any, path: Path, trust_pickles: bool) -> dict[str, Any]:
    """One full file (DDP's, a conversion's) loaded into a DeepSpeed strategy: weights, optimizer when fitting.

    Returns the dict, for Lightning's restore of the rest. What lets any checkpoint resume under ZeRO at any
    world size (``checkpoint/conversion.py``).
    """
    module = strategy.lightning_module
    checkpoint = load_file(path, trust_pickles, mmap=True)
    if strategy.zero_stage_3:
        restore_zero_state(strategy, checkpoint, strict=module.strict_loading)  # gathered, loaded, re-sharded
    else:
        module.load_state_dict(checkpoint["state_dict"], strict=module.strict_loading)
    if module.trainer.state.fn == TrainerFn.FITTING:  # evaluation builds an engine without a ZeRO optimizer
        with said_by_rank_zero(strategy.global_rank):
            load_full_into_zero(strategy.deepspeed_engine, checkpoint)
    return checkpoint


def load_full_into_zero(engine: Any, checkpoint: Mapping[str, Any]) -> None:
    """Load a full checkpoint's fp32 weights and optimizer state into a ZeRO engine's partitions (any stage, size).

    Each rank keeps its own slice, through DeepSpeed's public ``safe_set_full_fp32_param`` and
    ``safe_set_full_optimizer_state``. Before the first step the base optimizer holds no state: it is created
    here, per flat partition, with the checkpoint's keys, then filled; each group's settings (learning rate,
    betas, weight decay) are the checkpoint's. The module's own (possibly 16-bit) weights are the caller's.

    Raises:
        BadInputError: the checkpoint's optimizer groups are not this optimizer's.

    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    groups, flats, base = zero_optimizer_parts(engine)
    names = {id(parameter): name for name, parameter in engine.module.named_parameters()}
    live = [[names[id(parameter)] for parameter in group] for group in groups]
    weights = checkpoint["state_dict"]
    parameters = dict(engine.module.named_parameters())
    for name in (name for group in live for name in group):
        safe_set_full_fp32_param(parameters[name], weights[name].detach().float())
    saved = list(checkpoint.get("optimizer_states") or [])
    if not saved:
        return
    named = keyed_by_name(saved[0], live)
    for name, state in named["state"].items():
        for key, value in state.items():
            size = getattr(parameters[name], "ds_numel", parameters[name].numel())
            if _per_element(value) and value.numel() != size:
                raise BadInputError(
                    f"the optimizer's {key!r} of {name} holds {value.numel()} values for a parameter of {size}: ZeRO "
                    "keeps optimizer state element by element beside each partition and cannot shard it. Resume "
                    "under ddp, fsdp or tp, which keep it as the optimizer made it"
                )
    if not len(named["param_groups"]) == len(flats) == len(base.param_groups):
        raise BadInputError(
            f"the checkpoint's optimizer has {len(named['param_groups'])} parameter groups; this ZeRO optimizer steps "
            f"{len(flats)} partitions (a ZeRO-3 sub_group_size smaller than a group): resume with the same groups"
        )
    # One partition per group, in the groups' order (stages 1 and 2; stage 3 with a sub-group per group).
    for flat, settings, group, names_in_group in zip(
        flats, named["param_groups"], base.param_groups, live, strict=True
    ):
        group.update({key: value for key, value in settings.items() if key != "params"})
        first = next((named["state"][name] for name in names_in_group if name in named["state"]), None)
        if first is not None:  # else a group that had not stepped when saved
            base.state[flat] = {
                key: torch.zeros_like(flat) if _per_element(value) else _copy(value) for key, value in first.items()
            }
    link_zero_optimizer_state(engine)
    for name, state in named["state"].items():
        for key, value in state.items():
            if _per_element(value):
                safe_set_full_optimizer_state(parameters[name], value.detach().float(), key)


def _per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
