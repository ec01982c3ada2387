"""Which modules of a LightningModule become FSDP units: classes named in YAML, sizes, and the root's children.

A root child is a unit of its own (embeddings, final norm, head); a container at the root (nanoGPT's
``self.layers = nn.ModuleList(...)``) is looked through, each member a unit.

Example::

    for unit in root_units(module):
        fully_shard(unit, mesh=mesh)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_mlopt.exceptions import BadInputError


def import_module_class(path: str, key: str) -> type[nn.Module]:
    """The ``torch.nn.Module`` class at import path ``path`` (YAML key ``key``, named in the ValueError otherwise)."""
    module_name, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"{key}: cannot import {path!r}; give the full import path of a module class") from None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{key}: {path!r} is not a torch.nn.Module class")
    return cls


def require_classes(module: nn.Module, classes: Sequence[type[nn.Module]], key: str) -> None:
    """Raise BadInputError naming the first of ``classes`` (YAML key ``key``) that no module of ``module`` is.

    The message lists the model's module classes, from which the right import path can be copied.
    """
    present = {type(sub) for sub in module.modules()}
    for cls in classes:
        if not any(issubclass(kind, cls) for kind in present):
            names = sorted(f"{kind.__module__}.{kind.__qualname__}" for kind in present)
            raise BadInputError(
                f"{key}: {cls.__module__}.{cls.__qualname__} is not in the model. "
                f"The model's module classes: {', '.join(names)}"
            )


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied anywhere in ``module`` (a model that shards itself is left alone)."""
    return any(isinstance(sub, FSDPModule) for sub in module.modules())


def root_units(module: nn.Module) -> Iterator[nn.Module]:
    """The root's children, with each container that defines no forward replaced by its members (recursively).

    FSDP gathers a unit's parameters in a hook on the unit's forward; an ``nn.ModuleList`` or ``nn.ModuleDict``
    is never called (the root iterates over it), so it cannot be a unit, and torch refuses to shard it.

    Example::

        [type(u).__name__ for u in root_units(nano_gpt)]   # ['Embedding', 'Block', 'Block', 'LayerNorm', 'Linear']
    """
    for child in module.children():
        if is_container(child):
            yield from root_units(child)
        else:
            yield child


def is_container(module: nn.Module) -> bool:
    """A ModuleList/ModuleDict (or subclass) that keeps ``nn.Module``'s forward: it holds modules, it is not called."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward


def select_by_size(module: nn.Module, threshold: int, wrapped: set[nn.Module], is_root: bool = False) -> int:
    """Mark modules holding >= threshold unwrapped parameters (post-order); return what stays unwrapped."""
    count = sum(p.numel() for p in module.parameters(recurse=False))
    for child in module.children():
        count += select_by_size(child, threshold, wrapped)
    if module in wrapped:
        return 0
    if not is_root and count >= threshold:
        wrapped.add(module)
        return 0
    return count


__all__ = ["import_module_class", "is_container", "is_sharded", "require_classes", "root_units", "select_by_size"]
