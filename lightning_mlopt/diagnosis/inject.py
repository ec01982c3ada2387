"""Fault injection, a testing aid: corrupt one rank's state on purpose to see the detectors catch it.

Set ``LIGHTNING_MLOPT_INJECT`` before launching; every rank reads it, and only the named rank acts::

    LIGHTNING_MLOPT_INJECT=bitflip:rank=1,step=7,param=layers.0.attn.qkv.weight python -m lightning_mlopt fit ...

``bitflip`` flips bit ``bit`` (default 16, a mantissa bit of fp32: the value changes by under 1%, invisible
to a NaN check) of the first element of the parameter whose name ends with ``param``, on rank ``rank``,
right after optimizer step ``step`` (ReplicaConsistencyCheck applies it). ``nan`` makes the output of the
module whose name ends with ``module`` NaN in the first forward of the batch that makes optimizer step
``step``, once (a transient fault: a re-run of that forward is clean; GradNormMonitor applies it). With
``repeat=true`` a bitflip happens again after every later step: a device or
link that corrupts the value each time it is written, which is what a fault looks like under ZeRO-1/2, whose
parameters are re-gathered from their owners' partitions after every step. Several injections are separated
by ``;``. Never set it in a real run.

Example::

    >>> parse("bitflip:rank=1,step=7,param=attn.qkv.weight")
    [Injection(kind='bitflip', rank=1, step=7, param='attn.qkv.weight', bit=16, repeat=False)]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_mlopt.diagnosis.bit_hash import integer_view
from lightning_mlopt.exceptions import BadInputError

ENV = "LIGHTNING_MLOPT_INJECT"
KINDS = ("bitflip", "nan")
_TARGET = {"bitflip": "param", "nan": "module"}


class Injection(NamedTuple):
    """One fault to inject (see the module docstring)."""

    kind: str
    rank: int
    step: int
    param: str  # bitflip: the parameter; nan: the module (the name's end)
    bit: int = 16
    repeat: bool = False

    def due(self, rank: int, step: int) -> bool:
        """Whether this rank injects after optimizer step ``step``."""
        return rank == self.rank and (step == self.step or (self.repeat and step > self.step))


def parse(text: str) -> list[Injection]:
    """The injections of a ``LIGHTNING_MLOPT_INJECT`` value; BadInputError naming the variable if malformed."""
    injections = []
    for part in filter(None, (piece.strip() for piece in text.split(";"))):
        kind, _, arguments = part.partition(":")
        if kind not in KINDS:
            raise BadInputError(f"{ENV}: unknown fault {kind!r}; known: {', '.join(KINDS)}")
        fields = dict(item.split("=", 1) for item in arguments.split(",") if "=" in item)
        target = _TARGET[kind]
        missing = [key for key in ("rank", "step", target) if key not in fields]
        if missing:
            raise BadInputError(f"{ENV}: {kind} needs {', '.join(missing)} (e.g. {kind}:rank=1,step=7,{target}=x)")
        try:
            injection = Injection(
                kind,
                int(fields["rank"]),
                int(fields["step"]),
                fields[target],
                int(fields.get("bit", 16)),
                fields.get("repeat", "false").lower() in ("1", "true", "yes"),
            )
        except ValueError:
            raise BadInputError(f"{ENV}: {part!r}: rank, step and bit must be integers") from None
        injections.append(injection)
    return injections


def from_environment(kind: str) -> list[Injection]:
    """The injections of ``kind`` configured in the environment (none when ``LIGHTNING_MLOPT_INJECT`` is unset)."""
    return [injection for injection in parse(os.environ.get(ENV, "")) if injection.kind == kind]


def find_parameter(module: nn.Module, suffix: str) -> tuple[str, nn.Parameter]:
    """The one parameter whose name ends with ``suffix`` (BadInputError when none or several do)."""
    return _one_named(module.named_parameters(), suffix, "param", "parameter")


def _one_named(named: Iterable[tuple[str, Any]], suffix: str, key: str, what: str) -> tuple[str, Any]:
    """The one ``(name, item)`` whose dotted name ends with ``suffix``; BadInputError naming ``key`` otherwise."""
    matches = [(name, item) for name, item in named if name == suffix or name.endswith(f".{suffix}")]
    if len(matches) != 1:
        found = f"no {what}" if not matches else f"{len(matches)} {what}s ({', '.join(n for n, _ in matches)})"
        raise BadInputError(f"{ENV}: {key}={suffix}: {found} match; give more of the name")
    return matches[0]


def flip_bit(param: torch.Tensor, bit: int) -> None:
    """Flip bit ``bit`` of the first element of ``param`` (its local shard), in place."""
    local = param.to_local() if hasattr(param, "to_local") else param
    first = integer_view(local)[:1]
    first.bitwise_xor_(torch.tensor(1 << bit, dtype=torch.int64).to(first.dtype))


def install_nan(module: nn.Module, injection: Injection, rank: int, current_step: Callable[[], int]) -> Any:
    """Make the named submodule's output NaN once, in the first forward of optimizer step ``injection.step``.

    ``current_step`` gives the optimizer steps done so far (the trainer's ``global_step``). Returns the hook's
    handle (``.remove()`` it at teardown).
    """
    _, target = find_module(module, injection.param)
    fired = [False]

    def poison(submodule: nn.Module, inputs: Any, output: Any) -> Any:
        if fired[0] or rank != injection.rank or current_step() + 1 != injection.step:
            return output
        fired[0] = True
        return output * float("nan") if isinstance(output, torch.Tensor) else output

    return target.register_forward_hook(poison)


def find_module(module: nn.Module, suffix: str) -> tuple[str, nn.Module]:
    """The one submodule whose name ends with ``suffix`` (BadInputError when none or several do)."""
    return _one_named(module.named_modules(), suffix, "module", "module")
