"""Probing a model for the memory planner: its optimizer's kind and its activations, without using memory.

Example::

    with torch.device("meta"):
        model = instantiate({"class_path": "lightning_mlopt.demos.GPTLanguageModel"})
    optimizer_kind(model)   # 'adam'
"""

from __future__ import annotations

import importlib
from typing import Any

import torch


def instantiate(section: dict[str, Any]) -> Any:
    """The object a ``class_path``/``init_args`` section of a config describes (a model, a datamodule)."""
    module_name, _, name = section["class_path"].rpartition(".")
    return getattr(importlib.import_module(module_name), name)(**(section.get("init_args") or {}))


def optimizer_kind(model: Any) -> str:
    """What the planner needs of a model's optimizer: ``adam`` (two states), ``sgd_momentum`` (one) or ``sgd``."""
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    if isinstance(optimizer, (list, tuple)):
        optimizer = optimizer[0]
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    momentum = optimizer.defaults.get("momentum", 0) if hasattr(optimizer, "defaults") else 0
    return "sgd_momentum" if momentum else "sgd"


def measure_activations(model: Any, data: Any) -> float:
    """Bytes of tensors the forward pass of one micro-batch saves for backward, on the meta device.

    No memory is used: the model is on the meta device and the batch is moved there; saved-tensor hooks
    add up what autograd keeps.
    """
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    batch = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in batch]
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    silenced = model.log
    try:
        model.log = lambda *args, **kwargs: None  # no Trainer here: training_step's logging has nowhere to go
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model.training_step(batch, 0)
    finally:
        model.log = silenced
    return float(sum(saved.values()))
