"""Each reach into a private name (lightning_mlopt/_compat.py) still works with the installed versions."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from lightning_mlopt import _compat


def test_lightning_signal_registration_keeps_our_handlers():
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)

    def ours(signum, frame):  # type: ignore[no-untyped-def]
        pass

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, ours)
    try:
        _compat.keep_lightning_off_signals(trainer, [signal.SIGTERM])
        trainer._signal_connector.register_signal_handlers()  # what Trainer._run does after the callbacks' setup
        assert signal.getsignal(signal.SIGTERM) is ours, "Lightning's SIGTERM handler (a collective inside) won"
        trainer._signal_connector.teardown()
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_missing_reach_fails_loudly_naming_it():
    with pytest.raises(_compat.CompatError, match=r"keeping our preemption handlers: object\._signal_connector"):
        _compat.keep_lightning_off_signals(object(), [signal.SIGTERM])


@pytest.mark.slow
def test_deepspeed_initialize_is_wrapped_only_inside_the_block():
    import deepspeed

    original = deepspeed.initialize
    seen = {}

    with _compat.deepspeed_initialize_on_rank(3):
        assert deepspeed.initialize is not original
        deepspeed_initialize = deepspeed.initialize
    assert deepspeed.initialize is original

    def fake(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.update(kwargs)

    deepspeed.initialize = fake
    try:
        with _compat.deepspeed_initialize_on_rank(3):
            deepspeed.initialize(args=None, model=None)
    finally:
        deepspeed.initialize = original
    assert seen["args"].device_rank == 3 and callable(deepspeed_initialize)


@pytest.mark.slow  # DeepSpeed's comm backend imported for real: 1.7 s alone, over the fast tier's 2 s beside a worker
def test_deepspeed_starts_its_cpu_backend_without_the_shm_op_only_inside_the_block():
    import importlib
    import inspect

    backend = importlib.import_module("deepspeed.comm.torch")
    original = backend.build_shm_op
    with _compat.deepspeed_without_shm_op():
        assert backend.build_shm_op() is None  # no compile, no load, no "built successfully"
    assert backend.build_shm_op is original
    # Where DeepSpeed calls it: a global looked up when the backend starts (a renamed call would skip nothing).
    assert "self.shm_comm_op = build_shm_op()" in inspect.getsource(backend.TorchBackend.__init__)


def test_a_preloaded_checkpoint_is_what_lightning_restores_from():
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)
    checkpoint = {"epoch": 3, "global_step": 7, "pytorch-lightning_version": pl.__version__, "state_dict": {}}
    _compat.preload_checkpoint(trainer, "/ckpt/state.ckpt", checkpoint)
    assert trainer._checkpoint_connector._ckpt_path == "/ckpt/state.ckpt"
    assert trainer._checkpoint_connector._loaded_checkpoint["global_step"] == 7


def _fitted_trainer():
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    return trainer


def test_the_checkpoint_connector_dumps_and_resumes(tmp_path):
    trainer = _fitted_trainer()
    state = _compat.dump_checkpoint(trainer)
    assert state["global_step"] == 1 and "layer.weight" in state["state_dict"]
    path = tmp_path / "state.ckpt"
    trainer.save_checkpoint(path)
    _compat.resume_start(trainer, path, weights_only=False)
    assert trainer._checkpoint_connector._loaded_checkpoint["global_step"] == 1
    assert _compat.epoch_loaders(trainer)[1] is not None  # the fit created its combined loader
    # The stopping step's row goes through Lightning's own call after a batch's hooks (valid inside a batch only;
    # the requeued job of tests/goodput/test_goodput.py makes it there).
    assert callable(trainer._logger_connector.update_train_step_metrics)


def test_torch_and_interpreter_reaches_resolve():
    import threading

    import torch

    a, b = [torch.tensor([3.0, 4.0]), torch.ones(1)], [torch.ones(2), torch.ones(1)]
    assert [n.item() for n in _compat.foreach_norm(a, dtype=torch.float32)] == [5.0, 1.0]
    assert _compat.foreach_sub(a, b)[0].tolist() == [2.0, 3.0]
    _compat.foreach_mul_(b, torch.tensor(2.0))
    assert b[0].tolist() == [2.0, 2.0]
    assert callable(_compat.composable_checkpoint())
    assert _compat.default_store() is None  # no process group here
    assert threading.main_thread().ident in _compat.current_frames()
    import atexit

    assert callable(atexit._run_exitfuncs)  # run_exit_handlers' reach (calling it here would end pytest's)
    assert _compat.profiler_enabled() is False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert _compat.profiler_enabled() is True
    assert _compat.profiler_enabled() is False
    forward, backward = _compat.cpu_attention_ops()
    assert "flash_attention_for_cpu" in str(forward) and "backward" in str(backward)
    from torch.utils.flop_counter import FlopCounterMode

    given: list[type] = []

    def formula(a: torch.Tensor, b: torch.Tensor, out_val: torch.Tensor | None = None) -> int:
        given.append(type(a))
        return 7

    raw = _compat.raw_flop_formula(formula)
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.mm: raw}) as counter:
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    assert counter.get_total_flops() == 7 and given == [torch.Tensor]  # the tensor itself, not a shape
    # The CUDA memory reaches are exercised on a GPU (tests/test_gpu.py); here: they still exist.
    assert callable(torch.cuda.memory._record_memory_history) and callable(torch.cuda.memory._dump_snapshot)


def test_flop_counting_without_module_tracking_gives_the_same_total_and_allows_grad_of_leaf_inputs():
    from torch.utils.flop_counter import FlopCounterMode

    layer = torch.nn.Linear(8, 8)
    leaf = torch.ones(4, 8, requires_grad=True)  # what a pipeline stage receives
    with FlopCounterMode(display=False) as tracked:
        layer(leaf).sum().backward()
    with _compat.without_module_tracking(FlopCounterMode(display=False)) as untracked:
        (grad,) = torch.autograd.grad(layer(leaf).sum(), inputs=[leaf])  # rejected under the module tracker
    assert untracked.get_total_flops() == tracked.get_total_flops() - 2 * 4 * 8 * 8  # no weight gradient asked
    torch.testing.assert_close(grad, layer.weight.detach().sum(0).expand(4, 8))
    with FlopCounterMode(display=False), pytest.raises(RuntimeError, match="leaf node"):
        torch.autograd.grad(layer(leaf).sum(), inputs=[leaf])


def test_flop_counting_runs_an_op_with_a_kernel_of_its_own_as_it_runs_uncounted():
    from torch.utils.flop_counter import FlopCounterMode

    formulas = _compat.undecomposed_flop_formulas()
    assert torch.ops.aten.silu_backward.default in formulas and torch.ops.aten.mm not in formulas
    grad, gate = torch.randn(4096), torch.randn(4096)
    with FlopCounterMode(display=False, custom_mapping=formulas) as counter:
        counted = torch.ops.aten.silu_backward(grad, gate)
        torch.mm(torch.ones(2, 3), torch.ones(3, 2))
    assert torch.equal(counted, torch.ops.aten.silu_backward(grad, gate))  # the kernel's bits, not math_silu's
    assert counter.get_total_flops() == 2 * 2 * 3 * 2  # torch's own formulas still count


def test_argparse_reaches_list_every_key_of_the_cli():
    from jsonargparse import ArgumentParser

    from lightning_mlopt.cli.entry import _known_keys

    parser = ArgumentParser()
    parser.add_argument("--top")
    subcommands = parser.add_subcommands()
    fit = ArgumentParser()
    fit.add_argument("--trainer.max_steps")
    subcommands.add_subcommand("fit", fit)
    assert {"top", "trainer.max_steps"} <= _known_keys(parser)
    assert [action.dest for action in _compat.parser_actions(fit)][-1] == "trainer.max_steps"
    assert _compat.subcommand_parsers(fit) == []


def test_private_overrides_are_listed_and_still_exist():
    import importlib

    from lightning_mlopt import strategies
    from lightning_mlopt.callbacks import (
        FaultTolerantCheckpoint,
        GradNormMonitor,
        NCCLHealthCheck,
        ThroughputProgressBar,
    )
    from lightning_mlopt.cli import entry as cli
    from lightning_mlopt.tracking import WandbTracker

    for module, owner, name in _compat.PRIVATE_OVERRIDES:
        assert callable(getattr(getattr(importlib.import_module(module), owner), name, None)), f"{owner}.{name}"
    found = set()
    ours = [
        cli.MLOptCLI,
        cli.ParseOnlyCLI,
        strategies.DDPStrategy,
        strategies.FSDPStrategy,
        strategies.DeepSpeedStrategy,
    ]
    ours += [FaultTolerantCheckpoint, GradNormMonitor, NCCLHealthCheck, ThroughputProgressBar, WandbTracker]
    for cls in ours:
        for name in vars(cls):
            # Set by Python's own machinery in every subclass: abc's cache, typing.Protocol's flag (our hooks).
            if not name.startswith("_") or name.startswith("__") or name in ("_abc_impl", "_is_protocol"):
                continue
            for base in cls.__mro__[1:]:
                if name in vars(base) and not base.__module__.startswith("lightning_mlopt"):
                    found.add((base.__module__, base.__name__, name))
                    break
    assert found == set(_compat.PRIVATE_OVERRIDES)


def test_lightning_sees_configure_model_only_inside_the_block():
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.utilities.model_helpers import is_overridden

    model = BoringModel()
    assert not is_overridden("configure_model", model)
    with _compat.declare_configure_model(model):
        assert is_overridden("configure_model", model)  # what ModelParallelStrategy.setup checks
    assert not is_overridden("configure_model", model) and "configure_model" not in vars(model)


def test_callback_state_key_has_lightnings_format():
    from lightning.pytorch.callbacks import Callback

    class Keyed(Callback):
        pass

    assert _compat.callback_state_key(Keyed(), every=5).endswith("Keyed{'every': 5}")  # qualname, then the fields


def test_cli_subcommand_parser_is_the_running_parser():
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    cli = LightningCLI(BoringModel, run=False, args=[], save_config_callback=None)
    assert _compat.cli_subcommand_parser(cli, None) is cli.parser


def test_norm_layer_base_covers_batch_and_instance_norm_only():
    import torch.nn as nn

    base = _compat.norm_layer_base()
    assert isinstance(nn.BatchNorm1d(2), base) and isinstance(nn.InstanceNorm1d(2), base)
    assert not isinstance(nn.LayerNorm(2), base)


def test_strategy_timeout_is_the_one_given():
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    assert _compat.strategy_timeout(DDPStrategy(timeout=timedelta(minutes=3))) == timedelta(minutes=3)


def test_process_group_and_zero_reaches_exist():
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

    for owner, name in [
        (ModelParallelStrategy, "_setup_distributed"),
        (DeepSpeedStrategy, "_init_deepspeed_distributed"),
        (DeepSpeedStrategy, "_restore_zero_state"),
        (DeepSpeedStrategy, "_auto_select_batch_size"),
    ]:
        assert callable(getattr(owner, name, None)), f"{owner.__name__}.{name}"
    with pytest.raises(_compat.CompatError, match="setting up the process group on CPU"):
        _compat.setup_distributed(object())
    with pytest.raises(_compat.CompatError, match="setting up the process group on CPU"):
        _compat.init_deepspeed_distributed(object())


def test_context_parallel_reaches_exist():
    # Both run for real in tests/strategies/test_context_parallel.py (2 processes); here, that they still exist.
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh

    assert callable(funcol.all_to_all_single_autograd)
    assert callable(DeviceMesh._flatten)


def test_set_device_mesh_reaches_strategy_and_module():
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy, model = ModelParallelStrategy(), BoringModel()
    strategy.connect(model)
    mesh = object()
    _compat.set_device_mesh(strategy, mesh)
    assert strategy.device_mesh is mesh and model.device_mesh is mesh


def test_wandb_logger_reaches(tmp_path):
    from lightning.pytorch.loggers import WandbLogger

    logger = WandbLogger(save_dir=str(tmp_path), offline=True, id="abc123")
    assert _compat.wandb_requested_id(logger) == "abc123"
    assert _compat.wandb_init_kwargs(logger)["id"] == "abc123"
    assert _compat.wandb_run_if_started(logger) is None  # nothing started until .experiment


def test_route_torchrun_signals_asks_us_first_and_only_the_first_signal_reaches_torchrun():
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from lightning_mlopt._compat import route_torchrun_signals

    original = api._terminate_process_handler
    seen: list[int] = []
    try:
        route_torchrun_signals(lambda signum: (seen.append(signum), len(seen) == 1)[1])
        route_torchrun_signals(lambda signum: (seen.append(signum), len(seen) == 1)[1])  # one layer, not two
        with pytest.raises(SignalException) as raised:
            api._terminate_process_handler(signal.SIGTERM, None)
        assert seen == [signal.SIGTERM] and raised.value.sigval == signal.SIGTERM
        api._terminate_process_handler(signal.SIGINT, None)  # the second: recorded, torchrun not called
        assert seen == [signal.SIGTERM, signal.SIGINT]
    finally:
        api._terminate_process_handler = original


def test_torchrun_signals_the_worker_not_its_children(tmp_path):
    import subprocess
    import sys
    import time

    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    from lightning_mlopt._compat import signal_workers_not_their_children

    original = subprocess_handler.SubprocessHandler.close
    script = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))\n"
        "time.sleep(60)\n"
    )
    try:
        signal_workers_not_their_children()
        signal_workers_not_their_children()  # idempotent
        out = tmp_path / "out"
        handler = subprocess_handler.SubprocessHandler(
            sys.executable, ("-c", script), {}, str(out), None, local_rank_id=0, numa_options=None
        )
        deadline = time.monotonic() + 30
        while not out.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        grandchild = int(out.read_text().split()[0])
        handler.close(signal.SIGUSR1)
        assert handler.proc.wait(timeout=30) == 75  # the worker got the signal and handled it
        subprocess.run(["kill", "-0", str(grandchild)], check=True)  # its child was not signalled
        handler.close(signal.SIGKILL)  # the group, as torchrun does after the grace
        time.sleep(0.2)
        stat = Path(f"/proc/{grandchild}/stat")
        assert not stat.exists() or stat.read_text().split(")")[1].split()[0] == "Z"  # gone, or a zombie
    finally:
        subprocess_handler.SubprocessHandler.close = original


def test_the_per_batch_sigterm_broadcast_is_skipped(monkeypatch):
    import lightning.pytorch as pl
    import torch.distributed as dist

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)
    broadcasts = []
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src: broadcasts.append(int(tensor)))
    loop = trainer.fit_loop.epoch_loop
    loop._broadcast_sigterm_tensor()  # Lightning 2.6's own: a broadcast of the flag each batch
    assert broadcasts == [0]
    assert _compat.skip_per_batch_sigterm_broadcast(trainer)
    loop._broadcast_sigterm_tensor()
    assert broadcasts == [0], "the skipped broadcast still ran"


def test_zero3_starts_a_step_at_the_outermost_call_of_the_root_module_only():
    from types import SimpleNamespace

    import torch

    resets = []

    class Root(torch.nn.Module):  # Lightning's redirected forward: training_step calls self(x) inside
        def __init__(self) -> None:
            super().__init__()
            self.inner = False
            self.fail = False

        def forward(self, x):  # type: ignore[no-untyped-def]
            if self.fail:
                raise ValueError("a forward that raised")
            if not self.inner:
                self.inner = True
                try:
                    return self(x)
                finally:
                    self.inner = False
            return x

    root = Root()
    original = root.register_forward_pre_hook(lambda *_: resets.append("deepspeed's own"))
    coordinator = SimpleNamespace(reset_step=lambda: resets.append("reset"))
    offload = SimpleNamespace(module=root, fwd_pre_hook=original, get_param_coordinator=lambda: coordinator)
    engine = SimpleNamespace(optimizer=SimpleNamespace(parameter_offload=offload))

    assert _compat.zero3_step_starts_at_the_outermost_forward(engine)
    root(torch.ones(1))
    assert resets == ["reset"], "one reset per step, and DeepSpeed's own hook is gone"
    root.fail = True
    with pytest.raises(ValueError):
        root(torch.ones(1))
    root.fail = False
    root(torch.ones(1))
    assert resets == ["reset", "reset", "reset"], "a forward that raised still ended its call"
    offload.fwd_pre_hook.remove()  # what DeepSpeed's destroy does: both hooks go
    root(torch.ones(1))
    assert len(resets) == 3
    assert not _compat.zero3_step_starts_at_the_outermost_forward(SimpleNamespace(optimizer=None))


def test_each_training_batch_fetch_is_marked_where_the_loop_asks_the_dataloader(tmp_path):
    import lightning.pytorch as pl
    import torch

    events: list[str] = []

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> torch.Tensor:
            events.append("getitem")
            return torch.ones(2)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            events.append("step")
            return self.layer(batch).sum()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            return torch.utils.data.DataLoader(Data(), batch_size=4)

    class Mark(pl.Callback):  # from a batch's start: Lightning sets its own hook when each epoch's loop starts
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            assert _compat.mark_dataloader_fetches(trainer, lambda: events.append("fetch"))
            assert _compat.mark_dataloader_fetches(trainer, lambda: events.append("twice")), "idempotent"

    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[Mark()],
    )  # fmt: skip
    assert not _compat.mark_dataloader_fetches(trainer, lambda: None), "no fetcher before fit"
    trainer.fit(Model())
    fetched = ["getitem"] * 4
    assert events == [*fetched, "step", "fetch", *fetched, "step"], "the second batch's fetch is marked, once"


def test_progress_bar_metrics_stay_tensors_until_something_reads_them():
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel

    class LogsOnTheBar(BoringModel):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            out = super().training_step(batch, batch_idx)
            self.log("on_bar", out["loss"].detach() * 2, prog_bar=True)
            return out

    kept: list[object] = []

    class Look(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            if batch_idx:  # what the loop's per-batch bookkeeping left of the previous batch
                kept.append(trainer._logger_connector._progress_bar_metrics["on_bar"])

    _compat.defer_progress_bar_scalars()
    _compat.defer_progress_bar_scalars()  # idempotent
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, callbacks=[Look()],
    )  # fmt: skip
    trainer.fit(LogsOnTheBar())
    assert kept and all(isinstance(value, torch.Tensor) for value in kept), "converted after every batch"
    assert isinstance(trainer.progress_bar_metrics["on_bar"], float)  # readers still get numbers


def test_the_fit_loops_done_is_asked_without_its_stopped_line(caplog):
    import logging

    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", max_steps=0, logger=False, enable_progress_bar=False)
    with caplog.at_level(logging.INFO):
        assert trainer.fit_loop.done  # Lightning's own question: it says why
        said = caplog.text.count("`Trainer.fit` stopped")
        assert _compat.fit_loop_done_quietly(trainer)
    assert said == 1 and caplog.text.count("`Trainer.fit` stopped") == 1, "said once, by Lightning"
    assert not logging.getLogger("lightning.pytorch.utilities.rank_zero").disabled, "its other lines still said"


def test_lightning_row_step_is_the_label_of_lightnings_own_row():
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_mlopt._compat import lightning_row_step

    seen: list[tuple[int, int]] = []

    class Look(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((lightning_row_step(trainer), trainer.global_step))

    trainer = pl.Trainer(
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[Look()]
    )
    trainer.fit(BoringModel())
    assert seen == [(0, 1), (1, 2), (2, 3)]  # the update is counted in global_step, not yet in the row label


def test_compilations_are_told_with_their_trigger_and_id_and_a_recompilation_is_a_second_attempt():
    # What CompileWatch counts: one DYNAMO compilation per traced frame, its attempt above 0 when it recompiled.
    import torch

    from lightning_mlopt.perf.compile_watch import compile_watch

    watch = compile_watch()
    before = watch.record()

    @torch.compile(backend="eager", dynamic=False)
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    scaled(torch.ones(3))
    scaled(torch.ones(3))  # cached: nothing compiled
    scaled(torch.ones(5))  # a new static shape: the same frame again
    after = watch.record()
    assert after.compilations - before.compilations == 2
    assert after.recompilations - before.recompilations == 1 and after.first_recompile is not None
    assert after.seconds > before.seconds
