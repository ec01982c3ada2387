"""``strategy: auto``: run the planner at launch and train with the simplest strategy that fits."""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_mlopt.planning.memory import MemoryPlan, format_table, plan_memory

# Planner rows -> our strategy names. ZeRO-3's row is trained with FSDP: PyTorch-native, and its
# checkpoints reshard to other world sizes. With the optimizer offloaded, stage 2 is never worse than 1.
# HSDP's row (``hsdp<nodes>x<devices>``, on several nodes) is `hsdp`: FSDP within each node, replicated across.
STRATEGY_FOR_ROW = {
    "ddp": "ddp",
    "zero1": "zero1",
    "zero2": "zero2",
    "zero3/fsdp": "fsdp",
    "zero1+offload": "zero2_offload",
    "zero2+offload": "zero2_offload",
    "zero3/fsdp+offload": "zero3_offload",
}


def world_size_of(trainer: dict[str, Any]) -> int:
    """Processes the Trainer settings ask for: devices (a count, a list, or ``auto``) times nodes."""
    devices = trainer.get("devices", "auto")
    accelerator = str(trainer.get("accelerator", "auto"))
    if isinstance(devices, (list, tuple)):
        count = len(devices)
    elif isinstance(devices, int) or (isinstance(devices, str) and devices.isdigit()):
        count = int(devices)
    else:  # auto / -1
        use_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        count = torch.cuda.device_count() if use_gpu else 1
    return max(1, count) * int(trainer.get("num_nodes", 1) or 1)


def device_memory(trainer: dict[str, Any], world_size_per_node: int) -> int:
    """Memory one rank may use: the GPU's, or on CPU the host's memory shared by the node's processes."""
    accelerator = str(trainer.get("accelerator", "auto"))
    if torch.cuda.is_available() and accelerator in ("gpu", "cuda", "auto"):
        return int(torch.cuda.get_device_properties(0).total_memory)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(host // max(1, world_size_per_node))


def choose_strategy(config: dict[str, Any]) -> tuple[str | None, MemoryPlan, str]:
    """Plan a resolved config; return (our strategy name or None when nothing fits, the plan, its table).

    A model whose ``training_step`` does not run on the meta device (a Hugging Face model's mask code reads a
    tensor's value) is planned without activations, and the table ends with a line saying so: every rank plans,
    the caller prints the table on rank zero only.
    """
    from lightning_mlopt.planning.probe import MetaProbeError, instantiate, measure_activations, optimizer_kind

    trainer = config.get("trainer") or {}
    with torch.device("meta"):
        model = instantiate(config["model"])
    activations, notes = 0.0, []
    if config.get("data"):
        try:
            activations = measure_activations(model, instantiate(config["data"]))
        except MetaProbeError as error:
            notes.append(f"strategy: auto: {error}; planned from parameters, gradients and optimizer state only")
    world = world_size_of(trainer)
    per_node = world // int(trainer.get("num_nodes", 1) or 1)
    plan = plan_memory(
        sum(p.numel() for p in model.parameters()),
        world,
        device_memory(trainer, per_node),
        precision="mixed" if "mixed" in str(trainer.get("precision", "32")) else "fp32",
        optimizer=optimizer_kind(model),  # type: ignore[arg-type]
        activation_bytes=activations,
        replicate=int(trainer.get("num_nodes", 1) or 1),  # HSDP's replicas: one per node
    )
    recommendation = plan.recommendation or ""
    name = "hsdp" if recommendation.startswith("hsdp") else STRATEGY_FOR_ROW.get(recommendation)
    return name, plan, "\n".join([format_table(plan), *notes])
