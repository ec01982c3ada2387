"""Optimizer state keyed by parameter name, or by index: the two forms strategies write, and the bridge between them.

``torch.optim.Optimizer.state_dict()`` numbers parameters in the order of its groups (``{"state": {0: ...},
"param_groups": [{"params": [0, 1], ...}]}``); DCP and DeepSpeed's partitions, gathered, name them
(``"model.layers.0.attn.qkv.weight"``). A number means nothing without the optimizer that wrote it, and its
groups need not follow ``module.parameters()`` (a model that puts decayed weights in one group and biases in
another does not): so a numbered state is matched against the *live* optimizer, group by group, never
against the module's parameter order. A state that does not fit the live optimizer (other groups, other
parameters) is refused with the first difference named, never loaded into the wrong tensors.

Example::

    by_name = keyed_by_name(saved, group_names(optimizer, module))   # {"state": {"model.w": {...}}, ...}
    optimizer.load_state_dict(keyed_by_index(by_name, group_names(optimizer, module)))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_mlopt.exceptions import BadInputError


def is_keyed_by_name(state: Mapping[str, Any]) -> bool:
    """Whether an optimizer state dict names its parameters (DCP, a gathered ZeRO state) instead of numbering them."""
    groups = state.get("param_groups") or []
    return any(isinstance(name, str) for group in groups for name in group.get("params", []))


def group_names(optimizer: Optimizer, module: nn.Module) -> list[list[str]]:
    """The parameter names of each of ``optimizer``'s groups, in its order, as ``module`` names them.

    Raises:
        BadInputError: the optimizer holds a parameter that is not in ``module``.

    """
    names: dict[int, str] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), name)  # a tied parameter goes by its first name, as state dicts name it
    grouped = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise BadInputError(f"the optimizer holds {len(missing)} parameter(s) that are not in the model")
        grouped.append([names[id(p)] for p in group["params"]])
    return grouped


def keyed_by_name(state: Mapping[str, Any], live: list[list[str]]) -> dict[str, Any]:
    """``state`` with its parameters named; a numbered state is read in the order of the live groups' names.

    ``live``: the names of the live optimizer's parameters, group by group (:func:`group_names`).

    Raises:
        BadInputError: the numbered state's groups do not have the sizes of the live optimizer's.

    """
    if is_keyed_by_name(state):
        return dict(state)
    saved_groups = state.get("param_groups") or []
    sizes = [len(group["params"]) for group in saved_groups]
    if sizes != [len(names) for names in live]:
        raise BadInputError(
            f"the checkpoint's optimizer has parameter groups of sizes {sizes}; this run's has "
            f"{[len(names) for names in live]}: configure_optimizers must build the same groups to resume"
        )
    name_of: dict[Any, str] = {}
    groups = []
    for saved, names in zip(saved_groups, live, strict=True):
        name_of.update(zip(saved["params"], names, strict=True))
        groups.append({**saved, "params": list(names)})
    per_parameter = {name_of[index]: value for index, value in state.get("state", {}).items()}
    return {"state": per_parameter, "param_groups": groups}


def keyed_by_index(state: Mapping[str, Any], live: list[list[str]]) -> dict[str, Any]:
    """``state`` numbered for ``optimizer.load_state_dict``: a named state mapped through the live groups' names.

    Raises:
        BadInputError: the named state's groups hold other parameters than the live optimizer's.

    """
    if not is_keyed_by_name(state):
        return dict(state)
    saved_groups = state.get("param_groups") or []
    if len(saved_groups) != len(live):
        raise BadInputError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter group(s), this run's {len(live)}: "
            "configure_optimizers must build the same groups to resume"
        )
    index_of: dict[str, int] = {}
    groups = []
    for number, (saved, names) in enumerate(zip(saved_groups, live, strict=True)):
        if set(saved["params"]) != set(names):
            differ = sorted(set(saved["params"]) ^ set(names))
            raise BadInputError(
                f"parameter group {number} of the checkpoint's optimizer holds other parameters than this run's "
                f"(first difference: {differ[0]}): configure_optimizers must build the same groups to resume"
            )
        start = len(index_of)
        index_of.update((name, start + position) for position, name in enumerate(names))
        groups.append({**saved, "params": [index_of[name] for name in names]})
    per_index = {index_of[name]: value for name, value in state.get("state", {}).items()}
    return {"state": per_index, "param_groups": groups}


def is_flattened(state: Mapping[str, Any]) -> bool:
    """Whether an optimizer state is torch's flattened form (``state.<name>.<key>``, ``param_groups.<name>.<key>``).

    torch writes it with ``StateDictOptions(flatten_optimizer_state_dict=True)``: every entry is one
    parameter's, so the states of ranks that hold different parameters (pipeline stages) merge in one DCP
    checkpoint, where the nested form's group lists would collide.
    """
    return bool(state) and all(key.startswith(("state.", "param_groups.")) for key in state)


GROUP_INDEX = "_group_index"
"""A flattened state's extra per-parameter setting: the index of the group that held it (pipeline stages write it).

torch's flattened form keeps each parameter's group settings but not which group: two groups with the same
settings would merge, and the groups' order would follow the keys'.
"""


def flattened_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer``'s state for ``module``'s parameters in torch's flattened form, each with its group index.

    What a pipeline stage saves (see :func:`is_flattened`); tensors on the CPU.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
    state: dict[str, Any] = dict(get_optimizer_state_dict(module, optimizer, options=options))
    for index, names in enumerate(group_names(optimizer, module)):  # which group each parameter was in
        state.update({f"param_groups.{name}.{GROUP_INDEX}": index for name in names})
    return state


def unflattened(state: Mapping[str, Any]) -> dict[str, Any]:
    """The named form of torch's flattened optimizer state (``{"state": {name: {...}}, "param_groups": [...]}``).

    Parameters form groups by :data:`GROUP_INDEX` where the state records it, in its order; else by equal
    settings, in the order they come (a named state is matched to the live optimizer's groups by name anyway).

    Example::

        >>> unflattened({"state.w.step": 1, "param_groups.w.lr": 0.1, "param_groups.b.lr": 0.1})
        {'state': {'w': {'step': 1}}, 'param_groups': [{'lr': 0.1, 'params': ['w', 'b']}]}
    """
    per_parameter: dict[str, dict[str, Any]] = {}
    settings: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        kind, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        (per_parameter if kind == "state" else settings).setdefault(name, {})[field] = value
    indexed: dict[int, dict[str, Any]] = {}
    by_settings: list[dict[str, Any]] = []
    for name, group_settings in settings.items():
        index = group_settings.pop(GROUP_INDEX, None)
        if index is not None:
            group = indexed.setdefault(int(index), {**group_settings, "params": []})
        else:
            found = next((g for g in by_settings if _settings(g) == group_settings), None)
            if found is None:
                found = {**group_settings, "params": []}
                by_settings.append(found)
            group = found
        group["params"].append(name)
    ordered = [indexed[index] for index in sorted(indexed)] + by_settings
    return {"state": per_parameter, "param_groups": ordered}


def _settings(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def restricted_to(state: Mapping[str, Any], live: list[list[str]]) -> dict[str, Any]:
    """A named state cut down to the parameters of ``live`` (a pipeline stage's share of a whole-model state).

    Each live group takes the settings of the saved group that held its first parameter.
    """
    named = dict(state)
    group_of = {name: group for group in named.get("param_groups") or [] for name in group["params"]}
    groups = [{**group_of.get(names[0], {}), "params": list(names)} if names else {"params": []} for names in live]
    kept = {name for names in live for name in names}
    per_parameter = {name: value for name, value in named.get("state", {}).items() if name in kept}
    return {"state": per_parameter, "param_groups": groups}
