"""A strategy family described in one place: its class, YAML names, overlay and checkpoint layout.

The table in ``strategies/__init__.py`` is a tuple of these, one per family; everything else is derived from
it: the names the CLI accepts and registers in Lightning's ``StrategyRegistry``, the class's
``strategy_name``, the layouts resume and the checkpoint tool know (with their readers), and the overlay a test
checks against the class. A new strategy (tensor parallel, say) is one module with its class and its ``SPEC``,
one entry in the table, its overlay file and its tests.

Example::

    SPEC = StrategySpec(
        DDPStrategy,
        names={"ddp": ({}, "DDP, CPU (gloo) or GPU (NCCL)"), "ddp_fp16": ({"comm_hook": "fp16"}, "...")},
        layout=CheckpointLayout(ONE_FILE, DDPStrategy.consolidate_checkpoint, recognise=Path.is_file),
        overlays=("ddp.yaml",),
    )
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.strategies import Strategy

from lightning_mlopt.checkpoint.layout import CheckpointLayout

REGISTRY_PREFIX = "mlopt_"  # our names in Lightning's registry: Lightning's own `ddp` keeps its meaning there


@dataclass(frozen=True)
class StrategySpec:
    """One strategy family.

    Args:
        strategy_class: the Lightning strategy class (a ``DeclaresContract`` subclass).
        names: YAML name -> (constructor arguments, one-line description); the first name is the family's,
            is the family's unless ``family`` says otherwise.
        layout: the checkpoint layout the class writes (``checkpoint_layout`` on the class must name it).
        overlays: files under ``configs/strategies/`` that configure this class, for users to copy.
        family: the family's name, giving the class its ``strategy_name`` (``mlopt_<family>``); default: the
            first of ``names``.

    Raises:
        ValueError: no names, or a layout other than the one the class declares.

    """

    strategy_class: type[Strategy]
    names: Mapping[str, tuple[dict[str, Any], str]]
    layout: CheckpointLayout
    overlays: tuple[str, ...] = field(default_factory=tuple)
    family: str = ""

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError(f"{self.strategy_class.__name__}: a spec needs at least one YAML name")
        declared = getattr(self.strategy_class, "checkpoint_layout", None)
        if declared != self.layout.name:
            raise ValueError(
                f"{self.strategy_class.__name__} declares checkpoint_layout {declared!r}; its spec's layout is "
                f"{self.layout.name!r}"
            )
        if not self.family:
            object.__setattr__(self, "family", next(iter(self.names)))  # frozen: set once, here
        # Derived, not written twice: Lightning reads it when a registry lists the class.
        self.strategy_class.strategy_name = registered_name(self.family)  # type: ignore[attr-defined]


def registered_name(name: str) -> str:
    """Lightning-registry name of one of our strategies: ``ddp`` -> ``mlopt_ddp``."""
    return f"{REGISTRY_PREFIX}{name}"


def names_table(specs: Iterable[StrategySpec]) -> dict[str, tuple[type[Strategy], dict[str, Any], str]]:
    """YAML name -> (class, constructor arguments, description), for every name of every spec.

    Raises:
        ValueError: two specs claim one name.

    """
    table: dict[str, tuple[type[Strategy], dict[str, Any], str]] = {}
    for spec in specs:
        for name, (init_args, description) in spec.names.items():
            if name in table:
                raise ValueError(f"strategy name {name!r} is claimed by {table[name][0].__name__} and "
                                 f"{spec.strategy_class.__name__}")  # fmt: skip
            table[name] = (spec.strategy_class, init_args, description)
    return table


def layouts_table(specs: Iterable[StrategySpec]) -> dict[str, CheckpointLayout]:
    """Layout name -> layout, for every spec (families sharing a layout share its entry)."""
    return {spec.layout.name: spec.layout for spec in specs}
