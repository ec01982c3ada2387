"""Which collectives a stretch of training issued, and who asked for each: the strategy, us, or Lightning.

``torch.profiler`` records every collective a process group runs as a ``c10d::`` operator (``allreduce_``,
``broadcast_``, ``_allgather_base_``, ...), on any backend (gloo, NCCL), with the Python frames that led to it
(``with_stack=True``). Each is attributed to its innermost caller outside the communication layer
(``torch.distributed``'s functions, DeepSpeed's ``deepspeed.comm``, Lightning's ``broadcast``/``reduce``/
``barrier`` wrappers, CollectiveSequenceCheck's recorder), which names who wanted it:

- ``strategy``: the parallelism itself: torch (the DDP reducer, ``fully_shard``, ``clip_grad_norm_``),
  DeepSpeed's engine, and the strategy classes (ours in ``lightning_mlopt/strategies``, Lightning's);
- ``lightning_mlopt``: our callbacks and helpers (the per-step exchange);
- ``lightning``: Lightning's loops and trainer (2.6's per-batch SIGTERM broadcast was one);
- ``other``: anything else (the user's module, a test's callback).

The profiler's Python tracer slows what it records: this is for tests and benchmarks that hold a step's
communication to a budget, not for a production run.

Example::

    with CollectiveCounter() as counter:
        train_one_step()
    counter.by_issuer()     # {"strategy": 1, "lightning_mlopt": 1}
    counter.calls           # [Collective(op="allreduce", issuer="strategy", site="torch/autograd/graph.py:..."), ...]
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import PurePosixPath
from types import TracebackType
from typing import Any

_PACKAGES = ("lightning_mlopt", "lightning", "torch", "deepspeed")
_FRAME = re.compile(r"^(?P<file>.+\.py)\((?P<line>\d+)\): (?P<function>.+)$")
# Frames that carry a collective for someone else: the caller beyond them is who asked for it.
_COMM_LAYER_FILES = (
    "torch/distributed/distributed_c10d.py",
    "torch/distributed/c10d_logger.py",
    "torch/distributed/_functional_collectives.py",
    "torch/distributed/_functional_collectives_impl.py",
    "lightning/fabric/utilities/distributed.py",
    "lightning_mlopt/distributed/collective_recorder.py",  # CollectiveSequenceCheck's wrappers around them
)
_COMM_LAYER_DIRS = ("deepspeed/comm/",)
# Decorators between a caller and torch's function (typing_extensions' and warnings' ``deprecated``).
_TRANSPARENT_FILES = ("typing_extensions.py", "warnings.py")
_LIGHTNING_WRAPPERS = {"broadcast", "reduce", "barrier", "all_gather", "reduce_boolean_decision"}
# Our subpackages that act for their caller: a collective there counts for whoever called them.
_OUR_HELPERS = {"distributed", "diagnosis", "checkpoint", "perf", "process", "_compat.py"}


@dataclass(frozen=True)
class Collective:
    """One collective: the operator (``allreduce``, ``broadcast``, ...), who asked for it, and the calling frame."""

    op: str
    issuer: str
    site: str


def _package_path(file: str) -> str | None:
    """``file`` from its package down (``torch/distributed/fsdp/...``), whatever folder holds the package."""
    parts = PurePosixPath(file.replace("\\", "/")).parts
    for index in range(len(parts) - 2, -1, -1):  # the innermost package folder: a clone may be named like one
        if parts[index] in _PACKAGES:
            return "/".join(parts[index:])
    return None


def _in_comm_layer(path: str, function: str) -> bool:
    if path.startswith(_COMM_LAYER_FILES) or path.startswith(_COMM_LAYER_DIRS):
        return True
    return path.startswith(("lightning/pytorch/strategies/", "lightning/fabric/strategies/")) and (
        function in _LIGHTNING_WRAPPERS
    )


def _role(path: str) -> str | None:
    """Who a frame of ``path`` speaks for, or None for a helper that acts on a caller's behalf."""
    package, _, rest = path.partition("/")
    if package in ("torch", "deepspeed") or "/strategies/" in path or path.startswith("lightning/pytorch/plugins/"):
        return "strategy"
    if package == "lightning_mlopt":
        return None if rest.split("/", 1)[0] in _OUR_HELPERS else "lightning_mlopt"
    return "lightning"


def attribute(frames: list[str]) -> tuple[str, str]:
    """The issuer and calling site of a collective, from the profiler's frame names, innermost first.

    The innermost frame outside the communication layer names the site; the issuer is the first frame from
    there outward that speaks for someone: our helpers (``lightning_mlopt/distributed``, ...) act for their
    caller (a callback, or our FSDP strategy's clipping). torch's and DeepSpeed's own code counts as the
    strategy whoever called it.

    Example::

        >>> attribute(["torch/distributed/distributed_c10d.py(3155): all_reduce",
        ...            "lightning_mlopt/distributed/step_exchange.py(111): flush",
        ...            "lightning_mlopt/callbacks/fault_tolerant_checkpoint.py(420): on_train_batch_end"])
        ('lightning_mlopt', 'lightning_mlopt/distributed/step_exchange.py:flush')
        >>> attribute(["lightning_mlopt/distributed/grad_norm.py(84): global_grad_norm",
        ...            "lightning_mlopt/strategies/fsdp.py(200): clip_gradients"])
        ('strategy', 'lightning_mlopt/distributed/grad_norm.py:global_grad_norm')
        >>> attribute(["torch/distributed/distributed_c10d.py(3155): all_reduce",  # recorded: the same answer
        ...            "lightning_mlopt/distributed/collective_recorder.py(186): recorded",
        ...            "lightning_mlopt/distributed/step_exchange.py(111): flush",
        ...            "lightning_mlopt/callbacks/fault_tolerant_checkpoint.py(420): on_train_batch_end"])
        ('lightning_mlopt', 'lightning_mlopt/distributed/step_exchange.py:flush')
        >>> attribute([])  # no Python frame: the library's own C++ machinery
        ('strategy', '<c++>')
    """
    python_frames = [match for match in map(_FRAME.match, frames) if match is not None]
    if not python_frames:
        return "strategy", "<c++>"
    site = None
    for match in python_frames:
        if match["file"].endswith(_TRANSPARENT_FILES):
            continue
        path = _package_path(match["file"])
        if path is not None and _in_comm_layer(path, match["function"]):
            continue
        site = site or f"{path or match['file']}:{match['function']}"
        if path is None:
            return "other", site  # the user's code (or a test's)
        role = _role(path)
        if role is not None:
            return role, site
    if site is not None:  # only our helpers, all the way out
        return "lightning_mlopt", site
    return "other", f"{python_frames[-1]['file']}:{python_frames[-1]['function']}"


class CollectiveCounter:
    """Record the collectives issued inside a ``with`` block, each with its issuer (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: list[Collective] = []
        self._profiler: Any = None

    def __enter__(self) -> CollectiveCounter:
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], with_stack=True)
        self._profiler.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(kind, error, traceback)
        if kind is None:
            self.calls = [_collective(event) for event in profiler.events() if event.name.startswith("c10d::")]

    def by_issuer(self) -> dict[str, int]:
        """How many collectives each issuer asked for."""
        return dict(Counter(call.issuer for call in self.calls))

    def by_site(self, issuer: str) -> dict[str, int]:
        """``issuer``'s collectives by calling frame and operator (``path:function allreduce``)."""
        return dict(Counter(f"{call.site} {call.op}" for call in self.calls if call.issuer == issuer))


def _collective(event: Any) -> Collective:
    frames = []
    parent = event.cpu_parent
    while parent is not None:
        frames.append(parent.name)
        parent = parent.cpu_parent
    issuer, site = attribute(frames)
    return Collective(op=event.name.removeprefix("c10d::").strip("_"), issuer=issuer, site=site)


__all__ = ["Collective", "CollectiveCounter", "attribute"]
