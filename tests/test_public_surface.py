"""The YAML surface is pinned: a change to a public constructor is deliberate and goes in the CHANGELOG."""

from __future__ import annotations

import inspect

import pytest
from jsonargparse import ArgumentParser

from lightning_mlopt.callbacks import (
    FaultTolerantCheckpoint,
    GradNormMonitor,
    Keep,
    NCCLHealthCheck,
    PerformanceMonitor,
    Preemption,
    ReplicaConsistencyCheck,
    Resume,
    SaveOn,
    Stragglers,
    Tiers,
    Watchdog,
)
from lightning_mlopt.demos import (
    CIFAR10DataModule,
    DigitsDataModule,
    GPTLanguageModel,
    ResNetClassifier,
    TokenDataModule,
)
from lightning_mlopt.demos._loader import LoaderDataModule
from lightning_mlopt.goodput import GoodputLedger
from lightning_mlopt.process.notices import PreemptionNotices
from lightning_mlopt.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, TensorParallelStrategy
from lightning_mlopt.tracking import Delivery, MLflowTracker, ThroughputProgressBar, WandbTracker

LOADER = "batch_size num_workers pin_memory prefetch_factor persistent_workers"  # the loader keys, flat
PINNED = {
    DDPStrategy: "comm_hook powersgd_rank powersgd_start_iter bucket_cap_mb gradient_as_bucket_view static_graph "
    "find_unused_parameters timeout_minutes process_group_backend",
    FSDPStrategy: "wrap_classes min_params_to_wrap reshard_after_forward replicate_size activation_checkpointing "
    "param_dtype reduce_dtype cpu_offload save_distributed_checkpoint timeout_minutes process_group_backend "
    "replicate_group_size context_parallel_size position_key",
    TensorParallelStrategy: "tensor_parallel_size tp_plan wrap_classes min_params_to_wrap reshard_after_forward "
    "replicate_size activation_checkpointing param_dtype reduce_dtype cpu_offload save_distributed_checkpoint "
    "timeout_minutes process_group_backend replicate_group_size context_parallel_size position_key",
    DeepSpeedStrategy: "preset config offload_optimizer offload_parameters timeout_minutes process_group_backend",
    FaultTolerantCheckpoint: "dirpath every_n_steps every_n_minutes async_save save_on keep tiers preemption resume",
    SaveOn: "epoch_end train_end exception",
    Keep: "last every_n_steps monitor mode best",
    Tiers: "local_dirpath remote_every_n_steps remote_every_n_minutes",
    Preemption: "signals exit_code deadline_s grace_s",
    Resume: "auto final trust_pickles ckpt_path",
    GradNormMonitor: "log_every_n_steps depth param_norms update_ratios on_nonfinite locate_nonfinite on_spike "
    "spike_window spike_threshold spike_min_history rerun_on_anomaly min_loss_scale",
    NCCLHealthCheck: "barrier_timeout on_mismatch probe_mb probe_iterations min_busbw_gbps on_slow_bandwidth "
    "watchdog stragglers",
    Watchdog: "timeout adaptive_multiple exit_code dump_dir",
    Stragglers: "every_n_steps factor",
    PerformanceMonitor: "log_every_n_steps stall_threshold stall_window tokens_per_sample flops_per_sample count_flops "
    "measure_peak profile_steps oom_snapshot_entries",
    ReplicaConsistencyCheck: "every_n_steps on_mismatch",
    PreemptionNotices: "notices poll_interval_s",
    WandbTracker: "project name save_dir id mode entity group tags checkpoint_dir upload_checkpoints log_provenance",
    MLflowTracker: "experiment_name run_name tracking_uri tags save_dir prefix artifact_location run_id checkpoint_dir "
    "system_metrics_every_s delivery log_provenance",
    Delivery: "send_every_s flush_timeout_s hold_until_checkpoint",
    ThroughputProgressBar: "refresh_rate window leave log_every_n_steps min_interval_s",
    GoodputLedger: "path log_goodput",
    ResNetClassifier: "depth width in_channels num_classes lr weight_decay",
    GPTLanguageModel: "vocab_size block_size n_layer n_head d_model dropout lr weight_decay warmup_steps",
    LoaderDataModule: LOADER,
    CIFAR10DataModule: f"root synthetic_size augment {LOADER}",
    DigitsDataModule: f"val_fraction {LOADER}",
    TokenDataModule: f"vocab_size block_size num_sequences branching positions {LOADER}",
}


@pytest.mark.parametrize("cls", list(PINNED), ids=lambda c: c.__name__)
def test_constructor_arguments_are_pinned(cls):
    # The keys YAML accepts, as jsonargparse reads them: TP's ``**fsdp_options`` are FSDPStrategy's keys, and
    # ``**renamed`` (FaultTolerantCheckpoint) only refuses the keys of 0.1 by name: no key of its own.
    parser = ArgumentParser()
    parser.add_class_arguments(cls, "x")
    keys = [action.dest.split(".")[1] for action in parser._actions if action.dest.startswith("x.")]
    names = list(dict.fromkeys(keys))  # a group's own keys (keep.last, ...) under its one name
    assert names == PINNED[cls].split(), f"{cls.__name__}'s YAML keys changed: update PINNED, docs/ and CHANGELOG"


@pytest.mark.parametrize("cls", list(PINNED), ids=lambda c: c.__name__)
def test_every_public_class_and_key_is_documented(cls):
    from tests.conftest import REPO

    docs = "\n".join(path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    assert cls.__name__ in docs
    for name in PINNED[cls].split():
        assert f"`{name}`" in docs or name in docs, f"{cls.__name__}.{name} is in neither the README nor docs/"


def test_the_cli_packages_public_names_are_pinned():
    # quiet_lightning: the CLI's noise filters for a script's own Trainer (docs/configuration.md).
    import lightning_mlopt.cli as cli

    assert sorted(cli.__all__) == ["MLOptCLI", "check_arguments", "main", "print_config", "quiet_lightning"]
    assert all(callable(getattr(cli, name)) for name in cli.__all__)
    assert not inspect.signature(cli.quiet_lightning).parameters, "one call, nothing to configure"
