"""DeepSpeed's start-up on a machine without a GPU: no accelerator guess announced, no unused op built.

Two things DeepSpeed does there at start-up, and what we do instead:

- **It guesses the accelerator, and says so in every process.** Its first ``get_accelerator()`` (at
  ``import deepspeed``, which Lightning's strategy constructor runs) probes for CUDA and other devices and, finding
  none, warns "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." in
  each rank, and in ``checkpoint consolidate``/``convert`` (unpickling a ZeRO folder imports DeepSpeed).
  :func:`name_deepspeed_accelerator` names the CPU in ``DS_ACCELERATOR`` first where torch sees no accelerator:
  the same choice, made explicitly, which DeepSpeed does not announce. A ``DS_ACCELERATOR`` already set is kept.
- **It builds an op ZeRO never calls.** Its CPU torch backend JIT-compiles ``deepspeed_shm_comm`` (two C++ files,
  through ``torch.utils.cpp_extension``) into ``TORCH_EXTENSIONS_DIR`` (default
  ``~/.cache/torch_extensions/py<version>_cpu/``) on the first launch on each machine, which is every launch on a
  fresh VM, container or CI runner, then loads it and prints "... built successfully" in every rank on every
  launch, compiled or not. Its one caller is ``inference_all_reduce``, reached only from DeepSpeed's AutoTP layers
  in eval mode, which uses the process group's all-reduce when the op is absent. Unless the config turns AutoTP on
  (:func:`uses_shm_op`), the strategy starts the backend without it (``_compat.deepspeed_without_shm_op``). Where
  it is built, torch's folder is a per-machine cache that later launches reuse, and its build lock lets one
  process compile while the others wait (``build_locks`` removes a lock a killed build left behind).

Example::

    name_deepspeed_accelerator()  # before anything imports deepspeed
    quiet = nullcontext() if uses_shm_op(config) else deepspeed_without_shm_op()
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def name_deepspeed_accelerator() -> None:
    """Set ``DS_ACCELERATOR=cpu`` where torch sees no accelerator and none is named; call before ``import deepspeed``.

    DeepSpeed's own probe would pick the CPU there too: this only makes the choice explicit, so it is not announced.
    The variable is inherited by the ranks a launcher starts from this process.
    """
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.accelerator.is_available():  # no CUDA, MPS, XPU, ... device visible to torch
        os.environ["DS_ACCELERATOR"] = "cpu"


def uses_shm_op(config: Mapping[str, Any]) -> bool:
    """Whether a DeepSpeed config can reach the CPU shared-memory op: AutoTP on (``tensor_parallel.autotp_size > 1``).

    Example::

        >>> uses_shm_op({"zero_optimization": {"stage": 2}})
        False
        >>> uses_shm_op({"tensor_parallel": {"autotp_size": 2}})
        True
    """
    block = config.get("tensor_parallel") or {}
    return int(block.get("autotp_size") or 0) > 1
