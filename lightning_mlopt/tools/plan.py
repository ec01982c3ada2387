"""``python -m lightning_mlopt plan``: bytes per rank for each strategy, from a config or from numbers."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from lightning_mlopt.cli.bad_input import check_config_files
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.planning.memory import PipelineShare, format_table, parse_count, parse_size, plan_memory
from lightning_mlopt.planning.probe import MetaProbeError, instantiate, measure_activations, optimizer_kind
from lightning_mlopt.strategies import resolve_strategy
from lightning_mlopt.strategies.tensor.tp_plan import ResolvedPlan
from lightning_mlopt.tools._preamble import ToolArgumentParser, bad_input


def _merged_config(paths: Sequence[str]) -> dict[str, Any]:
    """The config files merged in order, each checked as ``fit`` checks it (a file, valid YAML, a mapping).

    Raises:
        BadInputError: a file is missing or not a YAML mapping, or ``trainer.strategy`` names no strategy.

    """
    check_config_files(paths)
    merged: dict[str, Any] = {}
    for path in paths:
        merged = _merge(merged, yaml.safe_load(Path(path).read_text()))
    strategy = (merged.get("trainer") or {}).get("strategy")
    if isinstance(strategy, str):  # a name the plan would otherwise ignore, and `fit` refuse
        try:
            resolve_strategy(strategy)
        except ValueError as error:
            raise BadInputError(f"trainer.strategy: {error}") from None
    return merged


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m lightning_mlopt plan``; returns the exit status."""
    parser = ToolArgumentParser(prog="python -m lightning_mlopt plan", description="Memory per rank for each strategy.")
    parser.add_argument("--config", action="append", default=[], help="config files (base, overlays)")
    parser.add_argument("--num_params", help="parameter count, e.g. 7.5B (instead of a config)")
    parser.add_argument("--world_size", type=int, help="data-parallel ranks (default: from the config)")
    parser.add_argument("--gpu_memory", default="80GB", help="memory per GPU, e.g. 80GB or 141GiB")
    parser.add_argument(
        "--replicate_size", type=int, help="HSDP replicas, for an hsdp row (default: the config's nodes, if > 1)"
    )
    parser.add_argument("--precision", choices=["mixed", "fp32"], help="default: from the config, else mixed")
    parser.add_argument("--optimizer", choices=["adam", "sgd_momentum", "sgd"], help="default: from the model")
    parser.add_argument("--activation_memory", default=None, help="activations per rank, e.g. 4GB")
    parser.add_argument("--headroom", type=float, default=0.1, help="fraction kept free (default 0.1)")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    args = parser.parse_args(list(argv))
    try:
        plan, placements, notes = _plan(args)
    except (ValueError, KeyError, ImportError, AttributeError, TypeError) as error:
        return bad_input(error)
    if args.format == "json":
        print(json.dumps(plan.to_dict(), indent=2))
        for note in notes:  # stdout stays one JSON document
            print(note, file=sys.stderr)
    else:
        print("\n".join([*placements, format_table(plan), *notes]))
    return 0


def _plan(args: argparse.Namespace) -> tuple[Any, list[str], list[str]]:
    """The memory plan, the tensor-parallel plan's placement of each module (lines; none without TP), and notes.

    A note (one line) says what the plan could not measure and why: a model whose ``training_step`` does not run
    on the meta device is planned from its parameters, gradients and optimizer state alone.
    """
    if not args.config and args.num_params is None:
        raise ValueError("give --config FILE or --num_params N")
    precision, optimizer, activations, tensor_parallel = args.precision, args.optimizer, 0.0, None
    pipeline: PipelineShare | None = None
    split_activations: float | None = None  # one tensor-parallel rank's, measured under the plan
    placements: list[str] = []
    notes: list[str] = []
    world_size = args.world_size
    replicate = 1  # HSDP's replicas: the config's node count
    context = 1  # context parallelism's ranks a sequence is split over (FSDP's context_parallel_size)
    if args.config:
        config = _merged_config(args.config)
        with torch.device("meta"):  # no memory for the parameters, however large the model
            model = instantiate(config["model"])
        num_params = sum(p.numel() for p in model.parameters())
        trainer = config.get("trainer") or {}
        replicate = int(trainer.get("num_nodes", 1) or 1)
        if precision is None:
            precision = "mixed" if "mixed" in str(trainer.get("precision", "32")) else "fp32"
        optimizer = optimizer or optimizer_kind(model)
        if world_size is None:
            devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
            if not isinstance(devices, int):
                raise ValueError(f"trainer.devices is {devices!r}: give --world_size")
            world_size = devices * nodes
        data = instantiate(config["data"]) if "data" in config and args.activation_memory is None else None
        if data is not None:
            try:
                activations = measure_activations(model, data)
            except MetaProbeError as error:
                data = None  # a tensor-parallel rank's measurement would fail the same way
                notes.append(
                    f"note: {error}; the table counts parameters, gradients and optimizer state only: "
                    "give --activation_memory SIZE to add them"
                )
        strategy = trainer.get("strategy")
        if isinstance(strategy, dict):
            context = int((strategy.get("init_args") or {}).get("context_parallel_size") or 1)
        pipeline, stage_lines = _pipeline(trainer, model, world_size)
        resolved, placements = _tensor_parallel(trainer, model, world_size)
        placements = stage_lines + placements + _features(config, model)
        if resolved is not None:
            tensor_parallel = (resolved.size, resolved.split_elements(model))
            if data is not None:
                with torch.device("meta"):  # a fresh model: the measurement splits the one it is given
                    fresh = instantiate(config["model"])
                try:
                    split_activations = measure_activations(fresh, data, around=resolved.split_on_fake_world(fresh))
                except MetaProbeError as error:
                    notes.append(f"note: one tensor-parallel rank's {error}; its rows count the whole model's")
    else:
        num_params = parse_count(args.num_params)
    if world_size is None:
        raise ValueError("give --world_size (a number >= 1)")
    if args.activation_memory is not None:
        activations = float(parse_size(args.activation_memory))
    plan = plan_memory(
        num_params,
        world_size,
        parse_size(args.gpu_memory),
        precision=precision or "mixed",
        optimizer=optimizer or "adam",
        activation_bytes=activations,
        headroom=args.headroom,
        tensor_parallel=tensor_parallel,
        tensor_parallel_activation_bytes=split_activations,
        pipeline=pipeline,
        replicate=args.replicate_size or replicate,
        context=context,
    )
    return plan, placements, notes


def _features(config: dict[str, Any], model: Any) -> list[str]:
    """A line for each of ``compile:`` and ``float8:`` turned on: what it takes of the model, what it does to rows.

    Chosen as the callbacks choose at fit (the same methods, on the meta-device model), so a block the compile
    would not find, or float8 with nothing to convert, is bad input here as there.
    """
    from lightning_mlopt.callbacks import CompileModel, Float8Training

    lines = []
    compile_args = dict(config.get("compile") or {})
    if compile_args.pop("enabled", False):
        compile_model = CompileModel(**compile_args)
        names = [name for name, _ in compile_model.regions_of(model)]
        lines.append(
            f"compile ({compile_model.regions}, {compile_model.backend}): {len(names)} region(s) ({names[0]}, ...); "
            "the rows are eager's (compiled kernels usually keep fewer activations)"
        )
    float8_args = dict(config.get("float8") or {})
    if float8_args.pop("enabled", False):
        float8 = Float8Training(**float8_args)
        chosen, kept = float8.choose(model)
        modules = dict(model.named_modules())
        converted = sum(modules[name].weight.numel() for name in chosen)
        total = sum(p.numel() for p in model.parameters())
        kept_text = "; ".join(f"{name} ({why})" for name, why in kept.items()) or "none"
        gather = (
            "; FSDP gathers their weights in float8 (1 byte an element, half of bf16)"
            if float8.fsdp_float8_all_gather
            else ""
        )
        lines.append(
            f"float8 ({float8.recipe}): {len(chosen)} linear layer(s) in float8 matmuls ({converted:,} of {total:,} "
            f"parameters); kept in high precision: {kept_text}. The rows are unchanged: parameters, gradients and "
            f"optimizer state keep their dtypes{gather}"
        )
    return lines


def _tensor_parallel(trainer: dict[str, Any], model: Any, world_size: int) -> tuple[ResolvedPlan | None, list[str]]:
    """The resolved plan when the config's strategy is tensor-parallel, and its placements, a line a module."""
    from lightning_mlopt.strategies import STRATEGIES, TensorParallelStrategy
    from lightning_mlopt.strategies.tensor.tp_plan import plan_of

    strategy = trainer.get("strategy")
    if isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith(TensorParallelStrategy.__name__):
        init_args = strategy.get("init_args") or {}
    elif isinstance(strategy, str) and STRATEGIES.get(strategy, (None,))[0] is TensorParallelStrategy:
        init_args = STRATEGIES[strategy][1]  # the YAML name's own arguments (fsdp_tp: tensor_parallel_size 2)
    else:
        return None, []
    devices = trainer.get("devices")
    # null: each node's devices; with devices: auto, the world given (one node)
    size = init_args.get("tensor_parallel_size") or (devices if isinstance(devices, int) else world_size)
    plan = plan_of(model, init_args.get("tp_plan"), size)  # as the strategy resolves it
    lines = [f"tensor-parallel plan ({size} ways, data-parallel {world_size // size}):"]
    lines += [f"  {line}" for line in plan.describe()]
    return plan, lines


def _pipeline(trainer: dict[str, Any], model: Any, world_size: int) -> tuple[PipelineShare | None, list[str]]:
    """What each pipeline rank holds when the config's strategy is pipeline-parallel, and a line per stage."""
    from lightning_mlopt.strategies import STRATEGIES, PipelineParallelStrategy
    from lightning_mlopt.strategies.pipeline.pp_split import check_split, stage_indices, stage_of_modules
    from lightning_mlopt.strategies.pipeline.pp_tensor import stage_plan

    strategy = trainer.get("strategy")
    if isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith(PipelineParallelStrategy.__name__):
        init_args = strategy.get("init_args") or {}
    elif isinstance(strategy, str) and STRATEGIES.get(strategy, (None,))[0] is PipelineParallelStrategy:
        init_args = STRATEGIES[strategy][1]
    else:
        return None, []
    pp = PipelineParallelStrategy(**init_args)  # the constructor's checks and defaults (no process group)
    size, stages, m, tensor = pp.pipeline_parallel_size, pp.stages, pp.microbatches, pp.tensor_parallel_size
    counts = check_split(model, pp.split_points, stages)
    total = sum(counts) or 1
    split, placements = [0] * stages, []  # each stage's parameters the tensor-parallel plan splits
    if tensor > 1:
        plan = stage_plan(model, pp.tp_plan, tensor)
        stage_of = stage_of_modules(model, pp.split_points)
        for name, elements in plan.split_elements_by_module(model).items():
            split[stage_of[name]] += elements
        placements = [
            f"tensor-parallel plan ({tensor} ways, within each stage):",
            *(f"  {line}" for line in plan.describe()),
        ]
    on_rank = [stage_indices(r, size, pp.stages_per_rank) for r in range(size)]
    per_rank = [sum(counts[s] for s in stages_of) for stages_of in on_rank]
    split_per_rank = [sum(split[s] for s in stages_of) for stages_of in on_rank]
    busiest = max(range(size), key=lambda r: per_rank[r] - split_per_rank[r] + split_per_rank[r] / tensor)
    # Micro-batches alive at once on the busiest rank: GPipe keeps all; 1F1B's rank r at most size - r.
    in_flight = m if pp.schedule.name in ("gpipe", "looped_bfs") else min(m, (size - busiest) * pp.stages_per_rank)
    lines = [
        f"pipeline plan ({size} ranks, {stages} stages, {pp.schedule.name}, {m} micro-batches, data-parallel "
        f"{world_size // (size * tensor)}{f', tensor-parallel {tensor}' if tensor > 1 else ''}; "
        f"bubble {pp.theoretical_bubble:.0%} in theory):"
    ]
    starts = ["(start)", *pp.split_points]
    for stage, count in enumerate(counts):
        rank = stage % size
        split_part = f", {split[stage]:,} split {tensor} ways" if tensor > 1 else ""
        lines.append(f"  stage {stage} on pipeline rank {rank}, from {starts[stage]}: {count:,} parameters "
                     f"({count / total:.0%}){split_part}")  # fmt: skip
    share = PipelineShare(
        size, per_rank[busiest], m, in_flight, per_rank[busiest] / total, tensor, split_per_rank[busiest]
    )
    return share, lines + placements
