"""How many heads a planned attention module really holds, and whether a tensor-parallel split keeps them whole.

Read from what the module holds: its own attributes (``n_head``, ``num_key_value_heads``...), else, in a module
with a ``head_dim`` of its own, its ``config`` (transformers 5 keeps the counts there), and its column-split
projections' widths over ``head_dim``. Each rank must hold whole query and key/value heads.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from torch import nn

from lightning_mlopt.exceptions import BadInputError

HEAD_COUNT_ATTRIBUTES = (
    "n_head",
    "n_heads",
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_kv_head",
    "n_kv_heads",
)
KEY_VALUE_HEAD_ATTRIBUTES = ("num_key_value_heads", "n_kv_head", "n_kv_heads")
# transformers 5's attention modules hold no counts of their own: they read these from their config.
CONFIG_HEAD_COUNT_FIELDS = ("num_attention_heads", "num_key_value_heads")
# The projections whose output width counts key/value heads; any other column-split one counts query heads.
KEY_VALUE_PROJECTIONS = ("k_proj", "v_proj", "key", "value", "wk", "wv", "k", "v")


@dataclass(frozen=True)
class _HeadCount:
    """A head count of an attention module, where it was read, and the planned module it constrains."""

    heads: int
    source: str  # what the message quotes, e.g. "config.num_key_value_heads=1" or "k_proj.out_features/head_dim=16/16"
    key_value: bool
    split: str


def check_head_counts(modules: Mapping[str, nn.Module], column_split: Collection[str], size: int) -> None:
    """Raise BadInputError when a planned attention module's head count does not divide by ``size``.

    ``column_split``: the planned module names whose output features are split (their widths count heads).

    Example::

        check_head_counts(dict(model.named_modules()), {"model.layers.0.self_attn.k_proj"}, 2)
    """
    for owner, module in modules.items():
        inside = [name for name in column_split if owner == "" or name.startswith(f"{owner}.")]
        if not inside:
            continue
        for count in _head_counts(owner, module, inside):
            if count.heads % size:
                raise BadInputError(_head_count_refusal(owner, count, size))


def _head_counts(owner: str, module: nn.Module, inside: list[str]) -> list[_HeadCount]:
    """The head counts ``module`` really holds: its own attributes, else its config's, then its split widths.

    The config is shared by the whole model (its MLP and wrappers hold it too), so it counts heads only in a
    module with a ``head_dim`` of its own: an attention module. The widths tell the truth whatever the
    attributes say: a column-split projection of ``n`` heads is ``n * head_dim`` wide.
    """

    def _int(value: object) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _split(key_value: bool) -> str:
        wanted = [name for name in inside if (name.rpartition(".")[2] in KEY_VALUE_PROJECTIONS) == key_value]
        return (wanted or inside)[0]

    counts: list[_HeadCount] = []
    for attribute in HEAD_COUNT_ATTRIBUTES:
        if (heads := _int(getattr(module, attribute, None))) is not None:
            key_value = attribute in KEY_VALUE_HEAD_ATTRIBUTES
            counts.append(_HeadCount(heads, f"{attribute}={heads}", key_value, _split(key_value)))
    head_dim = _int(getattr(module, "head_dim", None))
    if head_dim is None or head_dim < 1:
        return counts
    config = getattr(module, "config", None)
    for field in CONFIG_HEAD_COUNT_FIELDS:
        key_value = field == "num_key_value_heads"
        if any(count.key_value == key_value for count in counts):
            continue  # the module's own attribute says it
        if (heads := _int(getattr(config, field, None))) is not None:
            counts.append(_HeadCount(heads, f"config.{field}={heads}", key_value, _split(key_value)))
    children = dict(module.named_children())
    for name in inside:
        child = name.removeprefix(f"{owner}.")
        if child not in children:
            continue  # only the module's own column-split projections are viewed as its heads
        width = _int(getattr(children[child], "out_features", None))
        if width is not None and width % head_dim == 0:
            key_value = child in KEY_VALUE_PROJECTIONS
            source = f"{child}.out_features/head_dim={width}/{head_dim}"
            counts.append(_HeadCount(width // head_dim, source, key_value, name))
    return counts


def _head_count_refusal(owner: str, count: _HeadCount, size: int) -> str:
    kind = "key/value" if count.key_value else "query"
    plural = "head" if count.heads == 1 else "heads"
    sizes = [str(d) for d in range(2, count.heads + 1) if count.heads % d == 0][:4]
    fix = (
        f"use tensor_parallel_size {' or '.join(sizes)}, or"
        if sizes
        else f"{count.heads} {kind} {plural} cannot be split:"
    )
    return (
        f"tp_plan: {owner or 'the model'}.{count.source} does not divide by tensor_parallel_size={size} "
        f"({count.heads} {kind} {plural}), and {count.split} is split: each rank must hold whole heads; {fix} "
        f"leave {owner or 'the model'}'s projections out of the plan (split the MLP only)"
    )


__all__ = ["check_head_counts"]
