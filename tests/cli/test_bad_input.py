"""Every kind of bad input: a short message naming the cause and the fix, exit status 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mlopt.cli import main
from tests.conftest import CONFIGS


def _fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str) -> str:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), *args])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith("error: ")
    assert len(message.strip().splitlines()) <= 15, message
    assert "usage:" not in message
    # Nothing written: no run directory, no checkpoint, no log folder.
    assert list(tmp_path.iterdir()) == [p for p in tmp_path.iterdir() if p.suffix == ".yaml"]
    return message


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return name


def test_missing_config_file(tmp_path, monkeypatch, capsys):
    message = _fails(tmp_path, monkeypatch, capsys, "--config", "nope.yaml")
    assert "config file not found: nope.yaml" in message


def test_invalid_yaml_names_file_and_line(tmp_path, monkeypatch, capsys):
    name = _write(tmp_path, "broken.yaml", "trainer:\n  max_steps: [1,\n")
    message = _fails(tmp_path, monkeypatch, capsys, "--config", name)
    assert "broken.yaml: invalid YAML at line 3" in message


def test_unknown_key_names_file_and_suggests(tmp_path, monkeypatch, capsys):
    name = _write(tmp_path, "typo.yaml", "trainer:\n  max_step: 5\n")
    message = _fails(tmp_path, monkeypatch, capsys, "--config", name)
    assert "unknown key 'trainer.max_step' (set in typo.yaml)" in message
    assert "trainer.max_steps" in message


def test_wrong_type_names_key_and_value(tmp_path, monkeypatch, capsys):
    message = _fails(tmp_path, monkeypatch, capsys, "--trainer.max_epochs=many")
    assert "trainer.max_epochs (set on the command line)" in message
    assert "expected" in message and "many" in message


def _commit_stand_in(tmp_path_factory, layout: str, strategy: str, name: str = ".metadata", content: bytes = b"x"):
    """A committed step folder of ``layout`` whose state is no real checkpoint (it verifies; it does not load)."""
    from lightning_mlopt.checkpoint import CheckpointStore
    from lightning_mlopt.checkpoint.manifest import Manifest, describe_files

    store = CheckpointStore(tmp_path_factory.mktemp("saved"))
    staging = store.stage(4)
    (staging / "state.ckpt").mkdir()  # a folder of shards
    (staging / "state.ckpt" / name).write_bytes(content)
    manifest = Manifest(step=4, epoch=0, world_size=2, strategy=strategy, reason="test", layout=layout)
    manifest.files = describe_files(staging)
    store.commit(staging, manifest)
    return store.root / "step-000000004"


def test_a_checkpoint_in_a_layout_no_strategy_of_ours_reads(tmp_path, tmp_path_factory, monkeypatch, capsys):
    # DDP would otherwise fail deep in Lightning's restore: IsADirectoryError on the folder.
    step = _commit_stand_in(tmp_path_factory, "the format of OwnFormat", "OwnFormat")
    for given in (step, step / "state.ckpt"):
        message = _fails(tmp_path, monkeypatch, capsys, "--trainer.strategy=ddp", f"--ckpt_path={given}")
        assert (
            f"ckpt_path: {step} was written by OwnFormat as the format of OwnFormat, which the configured "
            "trainer.strategy cannot load" in message
        )
        assert f"checkpoint consolidate {step} <out.ckpt>" in message


def test_a_sharded_checkpoint_that_cannot_be_converted_is_refused_in_one_line(
    tmp_path, tmp_path_factory, monkeypatch, capsys
):
    # DeepSpeed's pointer to a tag folder that is not there.
    step = _commit_stand_in(tmp_path_factory, "ZeRO partitions", "DeepSpeedStrategy", "latest", b"checkpoint")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.strategy=ddp", f"--ckpt_path={step}"])
    message = capsys.readouterr().err
    assert exit_info.value.code == 2 and "\n" not in message.strip(), message
    assert message.startswith(f"error: ckpt_path: {step} (ZeRO partitions) cannot be converted: "), message
    # Written: only the note that tells the job's other processes (torchrun starts them all at once) why.
    written = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) == 1 and written[0].endswith(f"checkpoints/converted/.{step.name}.failed"), written
    assert step.is_dir() and (step / "manifest.json").is_file()  # the source is left as it was


@pytest.mark.slow
def test_unknown_strategy_lists_choices(tmp_path, monkeypatch, capsys):
    message = _fails(tmp_path, monkeypatch, capsys, "--trainer.strategy=dpp")
    assert "unknown strategy 'dpp'" in message
    suggested = message.split("Did you mean: ")[1].split("?")[0].split(", ")
    assert "ddp" in suggested  # with pp, as close to the typo
    assert "ddp_powersgd" in message  # our names are listed


@pytest.mark.slow
def test_unknown_class_path_lists_choices(tmp_path, monkeypatch, capsys):
    name = _write(tmp_path, "model.yaml", "model:\n  class_path: lightning_mlopt.demos.NoSuchNet\n")
    message = _fails(tmp_path, monkeypatch, capsys, "--config", name)
    assert "model (set in model.yaml)" in message
    assert "NoSuchNet" in message
    assert "lightning_mlopt.demos.ResNetClassifier" in message


def test_unknown_model_argument_lists_valid_ones(tmp_path, monkeypatch, capsys):
    message = _fails(tmp_path, monkeypatch, capsys, "--model.init_args.depthh=18")
    assert "depthh" in message
    assert "depth, width, in_channels" in message


@pytest.mark.slow
def test_out_of_range_value_is_reported_by_the_constructor(tmp_path, monkeypatch, capsys):
    message = _fails(tmp_path, monkeypatch, capsys, "--model.init_args.depth=19")
    assert "depth must be one of [18, 34, 50, 101], got 19" in message


@pytest.mark.slow
def test_wrong_strategy_knob(tmp_path, monkeypatch, capsys):
    name = _write(
        tmp_path,
        "knob.yaml",
        "trainer:\n  strategy:\n    class_path: lightning_mlopt.strategies.DDPStrategy\n"
        "    init_args:\n      comm_hook: fp16\n      powersgd_rank: 4\n",
    )
    message = _fails(tmp_path, monkeypatch, capsys, "--config", name)
    assert "powersgd_rank and powersgd_start_iter only apply with comm_hook: powersgd" in message


def test_invalid_choice_for_literal_knob(tmp_path, monkeypatch, capsys):
    name = _write(
        tmp_path,
        "hook.yaml",
        "trainer:\n  strategy:\n    class_path: lightning_mlopt.strategies.DDPStrategy\n"
        "    init_args:\n      comm_hook: fp8\n",
    )
    message = _fails(tmp_path, monkeypatch, capsys, "--config", name)
    assert "fp8" in message


def test_empty_config_file(tmp_path, monkeypatch, capsys):
    name = _write(tmp_path, "empty.yaml", "# nothing yet\n")
    message = _fails(tmp_path, monkeypatch, capsys, "--config", name)
    assert "empty.yaml is empty; a config file is a mapping of keys" in message


def test_a_folder_given_as_config(tmp_path, monkeypatch, capsys):
    (tmp_path / "overlays.yaml").mkdir()  # a folder named like a file: the worst case for "not found"
    message = _fails(tmp_path, monkeypatch, capsys, "--config", "overlays.yaml")
    assert "--config overlays.yaml is a folder, not a file" in message


def test_fsdp_wrap_class_not_in_the_model(tmp_path, monkeypatch, capsys):
    name = _write(
        tmp_path,
        "fsdp.yaml",
        "trainer:\n  devices: 2\n  strategy:\n    class_path: lightning_mlopt.strategies.FSDPStrategy\n"
        "    init_args:\n      wrap_classes: [torch.nn.TransformerEncoderLayer]\n",
    )
    message = _fails(
        tmp_path,
        monkeypatch,
        capsys,
        "--config",
        str(CONFIGS / "gpt.yaml"),
        "--config",
        name,
        "--trainer.accelerator=cpu",
    )
    assert "wrap_classes: torch.nn.modules.transformer.TransformerEncoderLayer is not in the model" in message
    assert "lightning_mlopt.demos.gpt.TransformerBlock" in message, "the model's classes are listed"


@pytest.mark.slow
def test_tensor_parallel_plan_that_does_not_fit_the_model(tmp_path, monkeypatch, capsys):
    # A typo in a glob would otherwise be skipped with a warning by parallelize_module, and train unsplit.
    name = _write(
        tmp_path,
        "tp.yaml",
        "trainer:\n  devices: 2\n  strategy:\n    class_path: lightning_mlopt.strategies.TensorParallelStrategy\n"
        "    init_args:\n      tp_plan: {model.layers.*.attn.qvk: colwise, model.layers.*.attn.proj: rowwise}\n",
    )
    gpt = ("--config", str(CONFIGS / "gpt.yaml"), "--trainer.accelerator=cpu")
    message = _fails(tmp_path, monkeypatch, capsys, *gpt, "--config", name)
    assert "'model.layers.*.attn.qvk' matches no module of the model. Nearest names: model.layers.*.attn.qkv" in message
    wide = _write(
        tmp_path,
        "tp4.yaml",
        (tmp_path / name).read_text().replace("tp_plan:", "tensor_parallel_size: 4\n      tp_plan:"),
    )
    message = _fails(tmp_path, monkeypatch, capsys, *gpt, "--config", wide)
    assert "tensor_parallel_size=4 must divide the world size (2 = devices x nodes)" in message


@pytest.mark.slow
def test_a_model_with_its_own_dataloaders_needs_no_data_section(tmp_path, monkeypatch, capsys):
    # Lightning's own BoringModel brings train/val dataloaders; LightningCLI accepts `data:` being absent.
    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit",
            "--model=lightning.pytorch.demos.boring_classes.BoringModel",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.logger=false",
            f"--run_dir={tmp_path / 'run'}",
        ]
    )
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert (tmp_path / "run" / "checkpoints" / "step-000000002").is_dir()


@pytest.mark.slow
def test_reversed_profile_window_names_the_key(tmp_path, monkeypatch, capsys):
    message = _fails(tmp_path, monkeypatch, capsys, "--performance.profile_steps=[8,4]")
    assert "profile_steps must be [start, stop] with 0 <= start < stop, got [8, 4]" in message


def test_unknown_performance_key_suggests_the_right_one(tmp_path, monkeypatch, capsys):
    message = _fails(tmp_path, monkeypatch, capsys, "--performance.stall_treshold=0.2")
    assert "performance.stall_threshold" in message


@pytest.mark.parametrize("url", ["gs://bucket/run", "file:///tmp/run"])
def test_a_url_as_checkpoint_dirpath_is_refused_not_taken_for_a_local_folder(tmp_path, monkeypatch, capsys, url):
    # pathlib reads s3://ckpt/runs/q as the relative folder s3:/ckpt/runs/q: the checkpoints would vanish with the node
    message = _fails(tmp_path, monkeypatch, capsys, f"--checkpoint.dirpath={url}")
    assert f"checkpoint.dirpath: '{url}' is a URL where a folder is expected" in message
    assert "or an S3-compatible store: s3://bucket/prefix" in message
    assert not (tmp_path / f"{url.split(':')[0]}:").exists()


def test_the_checkpoint_tool_refuses_a_url(tmp_path, monkeypatch, capsys):
    from lightning_mlopt.tools.checkpoint import main as checkpoint_tool

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        checkpoint_tool(["verify", "gs://ckpt/runs/q"])
    assert exit_info.value.code == 2
    assert "'gs://ckpt/runs/q' is a URL where a folder is expected" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flat", "grouped"),
    [("keep_last: 5", "checkpoint.keep.last"), ("auto_resume: false", "checkpoint.resume.auto")],
)
def test_a_flat_checkpoint_key_of_0_1_names_its_grouped_key(tmp_path, monkeypatch, capsys, flat, grouped):
    name = _write(tmp_path, "old.yaml", f"checkpoint:\n  {flat}\n")
    message = _fails(tmp_path, monkeypatch, capsys, "--config", name)
    old = flat.split(":")[0]
    assert f"checkpoint.{old} (set in old.yaml) is now {grouped}" in message


def test_a_bad_value_in_a_checkpoint_group_names_the_grouped_key(tmp_path, monkeypatch, capsys):
    message = _fails(tmp_path, monkeypatch, capsys, "--checkpoint.keep.last=0")
    assert "keep.last must be >= 1" in message


@pytest.mark.slow
def test_a_flat_mlflow_delivery_key_of_0_1_names_its_grouped_key(tmp_path, monkeypatch, capsys):
    logger = "trainer:\n  logger:\n    class_path: lightning_mlopt.tracking.MLflowTracker\n"
    name = _write(tmp_path, "mlflow.yaml", logger + "    init_args:\n      flush_timeout_s: 5\n")
    message = _fails(tmp_path, monkeypatch, capsys, "--config", name)
    assert "MLflowTracker: flush_timeout_s is now delivery.flush_timeout_s" in message
    assert len(message.strip().splitlines()) <= 3, message


def test_a_flat_health_check_key_of_0_1_names_its_grouped_key(tmp_path, monkeypatch, capsys):
    callbacks = "trainer:\n  callbacks:\n    - class_path: lightning_mlopt.callbacks.NCCLHealthCheck\n"
    name = _write(tmp_path, "health.yaml", callbacks + "      init_args:\n        straggler_factor: 2.0\n")
    message = _fails(tmp_path, monkeypatch, capsys, "--config", name)
    assert "NCCLHealthCheck: straggler_factor is now stragglers.factor" in message
    assert len(message.strip().splitlines()) == 2, message  # the cause, not the union's other tries


def _run_of_before(tmp_path: Path) -> Path:
    """A run folder as an earlier fit left it: its saved config and a checkpoint folder (step 66)."""
    run = tmp_path / "runs" / "quickstart-6ae16f55"
    (run / "checkpoints" / "step-000000066").mkdir(parents=True)
    (run / "config.yaml").write_text("# lightning.pytorch==2.6.6\nseed_everything: 1234\n")
    return run


def _fails_in(run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str) -> str:
    """``fit`` into the earlier run ``run`` exits 2 in one line, and leaves the run folder as it was."""
    before = {path: path.read_bytes() if path.is_file() else None for path in run.rglob("*")}
    monkeypatch.chdir(run.parent.parent)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), f"--run_dir={run}", *args])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith("error: ") and len(message.strip().splitlines()) == 1, message
    assert {path: path.read_bytes() if path.is_file() else None for path in run.rglob("*")} == before
    return message


def test_a_mistyped_ckpt_path_names_the_step_folder_meant(tmp_path, monkeypatch, capsys):
    run = _run_of_before(tmp_path)
    message = _fails_in(run, monkeypatch, capsys, f"--ckpt_path={run}/checkpoints/step-66")
    assert f"ckpt_path: {run}/checkpoints/step-66 does not exist" in message
    assert f"(did you mean {run}/checkpoints/step-000000066?)" in message


@pytest.mark.slow
def test_a_ckpt_path_that_is_no_checkpoint_is_refused_without_torchs_unsafe_advice(tmp_path, monkeypatch, capsys):
    run = _run_of_before(tmp_path)
    message = _fails_in(run, monkeypatch, capsys, f"--ckpt_path={CONFIGS / 'quickstart.yaml'}")
    assert "is not a checkpoint torch.load reads with weights_only=True (UnpicklingError)" in message
    assert "weights_only=False" not in message
    (run / "lightning_logs").mkdir()  # a folder, but no checkpoint: the configured strategy loads one file
    message = _fails_in(run, monkeypatch, capsys, f"--ckpt_path={run / 'lightning_logs'}")
    assert "is a folder with no checkpoint of ours in it" in message


def test_a_run_dir_holding_a_config_of_the_users_own_is_refused(tmp_path, monkeypatch, capsys):
    project = tmp_path / "runs" / "project"
    project.mkdir(parents=True)
    (project / "config.yaml").write_text("# my experiment, by hand\nmodel: {}\n")
    message = _fails_in(project, monkeypatch, capsys)
    assert f"run_dir: {project / 'config.yaml'} was not saved by a run" in message


def test_a_value_the_trainer_rejects_by_type_is_bad_input(tmp_path, monkeypatch, capsys):
    message = _fails(tmp_path, monkeypatch, capsys, "--trainer.devices=two")
    assert "`devices` selected with `CPUAccelerator` should be an int > 0" in message


@pytest.mark.slow
def test_a_relaunch_whose_checkpoint_does_not_fit_the_model_stops_in_one_line_and_keeps_the_runs_config(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    quiet = ["--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false"]
    common = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), f"--run_dir={run}", *quiet]
    main([*common, "--trainer.max_steps=2"])
    saved = (run / "config.yaml").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # the same run_dir, a narrower model: its checkpoint cannot load
        main([*common, "--trainer.max_steps=4", "--model.init_args.width=8", "--checkpoint.resume.final=true"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("error: ") and "step-000000002 does not fit this model: " in message, message
    assert "net.stem.0.weight: saved [16, 1, 3, 3], model [8, 1, 3, 3]" in message
    assert (run / "config.yaml").read_bytes() == saved and not (run / "earlier_configs").exists()
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")] == ["step-000000002"]


def test_a_class_argument_of_the_wrong_type_is_named_in_full_with_where_it_was_set(tmp_path, monkeypatch, capsys):
    message = _fails(tmp_path, monkeypatch, capsys, "--model.init_args.lr=abc")
    assert message.startswith("error: model.init_args.lr (set on the command line):"), message
    assert "expected float" in message and "NestedArg" not in message
    name = _write(tmp_path, "lr.yaml", "model:\n  init_args:\n    lr: abc\n")
    assert "error: model.init_args.lr (set in lr.yaml):" in _fails(tmp_path, monkeypatch, capsys, "--config", name)


def test_a_negative_startup_timeout_is_refused_not_taken_for_no_limit(tmp_path, monkeypatch, capsys):
    message = _fails(tmp_path, monkeypatch, capsys, "--startup_timeout=-1")
    assert "startup_timeout (set on the command line)" in message and "expected a number >=0" in message


def test_a_mistyped_subcommand_names_the_one_meant_and_every_tool(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fti", "--config", str(CONFIGS / "quickstart.yaml")])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith("error: unknown subcommand 'fti' (did you mean fit?); subcommands: fit, validate")
    assert "checkpoint" in message and "sweep" in message and list(tmp_path.iterdir()) == []


def test_a_ckpt_path_with_the_run_dir_placeholder_is_checked_once_it_is_filled_in():
    from lightning_mlopt.cli.ckpt_path import read_by_lightning

    read_by_lightning("{run_dir}/checkpoints/step-000000500", lambda: None)  # not refused as missing here
