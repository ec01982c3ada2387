"""The parity baseline: a hand-written training loop of the GPT demo, launched by torchrun.

    torchrun --nproc-per-node=2 benchmarks/parity/hand_loop.py --strategy fsdp --steps 60 --out /tmp/params.pt

What a careful user writes with the library alone (``DistributedDataParallel``; ``fully_shard`` per block and
on the model; ``parallelize_module`` with ``configs/strategies/tp.yaml``'s plan written out in torch's styles,
every rank reading the same batch; ``deepspeed.initialize`` with the preset's config), doing what
``configs/gpt.yaml`` asks of the Trainer: the same seed, model, data order (a ``DistributedSampler`` seeded as
Lightning seeds it), AdamW groups and warm-up (the demo's own ``configure_optimizers``), and gradient clipping
at the config's value. Rank 0 writes the full final parameters to ``--out`` (for the bitwise comparison)
after the last step.

``--set key=value`` overrides the config as the CLI's ``--model.init_args.n_layer=2`` would (the benchmark's
short-step model). Each rank uses ``cpus // processes`` threads, as Lightning's launcher sets them (torchrun
would give 1), so both sides run the same thread count on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

STRATEGIES = ("ddp", "fsdp", "tp", "pp", "zero1", "zero2", "zero3")
COUNTED_STEPS = (10, 12)  # warm steps, neither a logging step of configs/gpt.yaml on our side


def load_config(overrides: list[str]) -> dict[str, Any]:
    """``configs/gpt.yaml`` with ``model.init_args.X=V`` / ``data.init_args.X=V`` overrides applied."""
    config = yaml.safe_load((REPO / "configs" / "gpt.yaml").read_text())
    for item in overrides:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = yaml.safe_load(value)
    return config


def _deepspeed_config(strategy: str, micro_batch: int, clip: float) -> dict[str, Any]:
    """The preset's DeepSpeed block (the overlay's), with what Lightning's Trainer settings put in it."""
    from lightning_mlopt.strategies.deepspeed.deepspeed_strategy import _COMMON, PRESETS, merge_config

    config = merge_config(_COMMON, PRESETS[strategy])
    config.update(
        train_micro_batch_size_per_gpu=micro_batch,
        gradient_accumulation_steps=1,
        gradient_clipping=clip,
    )
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, default=None, help="rank 0 writes the final full parameters here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--step-times", type=Path, default=None, help="rank 0 writes each step's seconds here")
    parser.add_argument(
        "--count-collectives",
        type=Path,
        default=None,
        metavar="FILE",
        help="rank 0 writes each step's collectives by issuer here (COUNTED_STEPS, as the budget test counts)",
    )
    parser.add_argument(
        "--trace", default=None, metavar="START,STOP,FILE",
        help="rank 0 profiles steps START..STOP-1 into FILE (trace_window.py)",
    )  # fmt: skip
    args = parser.parse_args()

    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))  # what Lightning's launcher sets
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from lightning.fabric.utilities.seed import seed_everything

    from lightning_mlopt.demos import GPTLanguageModel, TokenDataModule
    from lightning_mlopt.demos._loader import already_batched

    config = load_config(args.set)
    seed = int(config["seed_everything"])
    seed_everything(seed, verbose=False)
    module = GPTLanguageModel(**config["model"]["init_args"])
    data = TokenDataModule(**config["data"]["init_args"])
    data.setup("fit")
    # Tensor and pipeline parallelism over the whole world: one data-parallel replica, every rank reads the batch.
    replicas, replica = (1, 0) if args.strategy in ("tp", "pp") else (world, rank)
    sampler = DistributedSampler(data.train_set, num_replicas=replicas, rank=replica, shuffle=True, seed=seed)
    sampler.set_epoch(0)
    batch_size = int(config["data"]["init_args"]["batch_size"])
    # The demo's batches are gathered whole (InMemoryTensors), as a careful user's in-memory pipeline does.
    loader = DataLoader(
        data.train_set, batch_size=batch_size, sampler=sampler, drop_last=True, collate_fn=already_batched
    )
    clip = float(config["trainer"]["gradient_clip_val"])

    if args.strategy.startswith("zero"):
        train = _deepspeed_loop(module, args.strategy, batch_size, clip, rank)
    elif args.strategy == "tp":
        train = _tensor_parallel_loop(module, world, clip)
    elif args.strategy == "pp":
        train, stage_module = _pipeline_loop(module, config, rank, clip)
    else:
        train = _torch_loop(module, args.strategy, clip)
    batches = iter(loader)
    window = None
    if args.trace:
        from trace_window import TraceWindow

        start, stop, out = args.trace.split(",", 2)
        window = TraceWindow(int(start), int(stop), Path(out))
    counted: list[dict[str, Any]] = []
    step_s: list[float] = []
    last: float | None = None
    for step in range(args.steps):
        try:
            batch = next(batches)
        except StopIteration:  # a new epoch, as Lightning's loop does it
            sampler.set_epoch(sampler.epoch + 1)
            batches = iter(loader)
            batch = next(batches)
        if window is not None:
            window.at_step(step)
        now = time.perf_counter()  # where StepClock stamps a Lightning step: the batch fetched, before the step
        if last is not None:
            step_s.append(now - last)
        last = now
        if args.count_collectives is not None and COUNTED_STEPS[0] <= step < COUNTED_STEPS[1]:
            from lightning_mlopt.diagnosis.collectives import CollectiveCounter

            with CollectiveCounter() as counter:
                train(batch)
            counted.append({"step": step, "by_issuer": counter.by_issuer(), "sites": counter.by_site("strategy")})
        else:
            train(batch)
    if window is not None:
        window.close()
    if args.step_times is not None and rank == 0:
        args.step_times.write_text(json.dumps({"step_s": step_s}))
    if args.count_collectives is not None and rank == 0:
        args.count_collectives.write_text(json.dumps({"batches": counted}))

    from lightning_mlopt.distributed import full_parameters

    params = full_parameters(module)  # a collective under FSDP and ZeRO-3: every rank calls it
    if args.strategy == "pp":  # each rank trained its stage's parameters: rank 0 gathers them all
        stages: list[Any] = [None] * world
        own = {name: p.detach().clone() for name, p in stage_module.named_parameters()}
        dist.all_gather_object(stages, own)
        params = {name: value for stage in stages for name, value in stage.items()}
    if rank == 0 and args.out is not None:
        torch.save(params, args.out)
    dist.barrier()
    dist.destroy_process_group()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The demo's loss (``GPTLanguageModel._loss``) on logits computed through the wrapped model."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _optimizer(module: Any) -> tuple[torch.optim.Optimizer, Any]:
    configured = module.configure_optimizers()
    if isinstance(configured, torch.optim.Optimizer):
        return configured, None
    return configured["optimizer"], configured["lr_scheduler"]["scheduler"]


def _torch_loop(module: Any, strategy: str, clip: float) -> Any:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from lightning_mlopt.demos.gpt import TransformerBlock

    if strategy == "ddp":
        model: nn.Module = DistributedDataParallel(module, bucket_cap_mb=25, gradient_as_bucket_view=True)
    else:
        for block in module.modules():
            if isinstance(block, TransformerBlock):
                fully_shard(block, reshard_after_forward=True)
        fully_shard(module.model, reshard_after_forward=True)
        model = module
    optimizer, scheduler = _optimizer(module)  # after sharding: its groups hold the sharded parameters

    def train(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, targets = batch
        loss = _loss(model(inputs), targets)
        loss.backward()
        if clip > 0:  # over the optimizer's parameters in its groups' order, as Lightning's clip_gradients does
            torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()

    return train


def _tensor_parallel_loop(module: Any, world: int, clip: float) -> Any:
    """``configs/strategies/tp.yaml``'s plan, written out as a user of ``parallelize_module`` writes it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {"model.token_embedding": RowwiseParallel(input_layouts=Replicate())}
    for index in range(len(module.model.layers)):
        layer = f"model.layers.{index}"
        plan[f"{layer}.attn.qkv"] = ColwiseParallel()
        plan[f"{layer}.attn.proj"] = RowwiseParallel()
        plan[f"{layer}.mlp.0"] = ColwiseParallel()
        plan[f"{layer}.mlp.2"] = RowwiseParallel()
    plan["model.lm_head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(module, init_device_mesh("cpu", (world,)), plan)
    optimizer, scheduler = _optimizer(module)
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def clip_gradients() -> None:
        # torch's clip_grad_norm_ refuses a mix of DTensors and plain tensors: the split pieces' squares are
        # summed over the ranks in one all-reduce; what every rank holds whole is counted once, locally.
        split, whole = [], []
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor):
                (split if any(p.is_shard() for p in grad.placements) else whole).append(grad.to_local())
            else:
                whole.append(grad)
        squares = torch.stack([g.float().pow(2).sum() for g in split]).sum()
        dist.all_reduce(squares)
        total = (squares + torch.stack([g.float().pow(2).sum() for g in whole]).sum()).sqrt()
        scale = (clip / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(split + whole, scale)

    def train(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, targets = batch
        loss = _loss(module(inputs), targets)
        loss.backward()
        if clip > 0:
            clip_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()

    return train


def _pipeline_loop(module: Any, config: dict[str, Any], rank: int, clip: float) -> tuple[Any, nn.Module]:
    """``configs/strategies/pp.yaml`` written with torch's pipelining alone: the demo cut where ``model.layers.2``
    begins, 1F1B over 8 micro-batches, AdamW over this rank's stage, clipping by the norm summed over stages."""
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    overlay = yaml.safe_load((REPO / "configs" / "strategies" / "pp.yaml").read_text())["trainer"]["strategy"]
    microbatches = int(overlay["init_args"]["microbatches"])
    split = {name: SplitPoint.BEGINNING for name in overlay["init_args"]["split_points"]}
    data, hparams = config["data"]["init_args"], config["model"]["init_args"]
    example = torch.zeros(int(data["batch_size"]) // microbatches, int(data["block_size"]), dtype=torch.long)
    stage = pipeline(module, mb_args=(example,), split_spec=split).build_stage(rank, torch.device("cpu"))
    schedule = Schedule1F1B(
        stage, microbatches, loss_fn=lambda out, target: _loss(out, target) / microbatches, scale_grads=False
    )
    params = list(stage.submod.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": float(hparams["weight_decay"])},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=float(hparams["lr"]),
        betas=(0.9, 0.95),
    )
    warmup = int(hparams["warmup_steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))

    def train(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, targets = batch
        if stage.is_first:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=[])
        if clip > 0:
            grads = [p.grad for p in params if p.grad is not None]
            squares = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
            dist.all_reduce(squares)  # the stages' sums: the whole model's norm
            torch._foreach_mul_(grads, (clip / (squares.sqrt() + 1e-6)).clamp(max=1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    return train, stage.submod


def _deepspeed_loop(module: Any, strategy: str, batch_size: int, clip: float, rank: int) -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    optimizer, scheduler = _optimizer(module)
    engine, _, _, _ = deepspeed.initialize(
        args=argparse.Namespace(device_rank=rank),
        config=_deepspeed_config(strategy, batch_size, clip),
        model=module,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
        optimizer=optimizer,
        lr_scheduler=scheduler,
        dist_init_required=False,
    )

    def train(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, targets = batch
        loss = _loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()  # clips, steps the optimizer and the scheduler, zeroes the gradients

    return train


if __name__ == "__main__":
    main()
