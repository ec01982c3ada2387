"""Configs are code: every file in configs/ parses and trains on 2 processes: a 2-step fit here,
or, for the overlays the session's shared strategy runs train, their 20 steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_mlopt.cli import main
from tests.conftest import CONFIGS, SMOKE

BASE_CONFIGS = sorted(CONFIGS.glob("*.yaml"))
OVERLAYS = sorted(CONFIGS.glob("strategies/*.yaml"))  # trackers/ are run and read back in test_tracking.py
# Overlays the session's shared strategy runs train anyway (20 steps, 2 processes, through the overlay file:
# tests/support/cli_args.py): not trained a second time here.
TRAINED_BY_SHARED_RUNS = {"ddp", "fsdp", "zero1", "zero2", "zero3"}
# Overlays tests/strategies/test_tensor_parallel.py trains against a one-process run (tp_hf.yaml on a
# Llama-shaped model: its globs name Hugging Face's modules, not the GPT demo's).
TRAINED_BY_TP_TESTS = {"tp", "fsdp_tp", "tp_hf", "tp_sp"}
# ... and tests/strategies/test_pipeline_parallel.py pp.yaml, against one process (the overlay by its file).
TRAINED_BY_PP_TESTS = {"pp"}
# ... tests/checkpoint/test_conversion.py zero3_offload.yaml (a ZeRO-2 checkpoint resumed under it, 2 processes),
# tests/cli/test_entry.py auto.yaml (the strategy it chose, against that strategy's own run), and
# tests/strategies/test_fsdp_variants.py hsdp.yaml (2 x 2 on 4 processes, against one process).
TRAINED_BY_OTHER_TESTS = {"zero3_offload", "auto", "hsdp", "cp"}  # cp: test_context_parallel.py
TRACKERS = sorted(CONFIGS.glob("trackers/*.yaml"))


def test_configs_exist():
    # Guards against a glob that silently matches nothing (and a suite that tests no config).
    assert {p.name for p in BASE_CONFIGS} >= {"quickstart.yaml", "gpt.yaml", "cifar.yaml"}
    assert CONFIGS / "strategies" / "ddp.yaml" in OVERLAYS
    assert {p.stem for p in TRACKERS} == {"csv", "mlflow", "tensorboard", "wandb"}  # each has a test in tracking/
    # No untested folder: features/compile.yaml and float8.yaml train in tests/callbacks/test_compile_model.py and
    # test_float8_training.py.
    assert {p.parent.name for p in CONFIGS.glob("*/*.yaml")} == {"features", "strategies", "trackers"}
    assert {p.name for p in CONFIGS.glob("features/*.yaml")} == {"compile.yaml", "float8.yaml"}


@pytest.mark.parametrize("config", BASE_CONFIGS, ids=lambda p: p.name)
@pytest.mark.slow
def test_base_config_fits_two_steps(config: Path, tmp_path: Path, monkeypatch, capsys, recwarn):
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(config), "--trainer.accelerator=cpu", "--trainer.devices=1", *SMOKE])
    # A config that chooses the optimizer (cifar.yaml: Adam and StepLR) replaces the demo's default quietly.
    assert not [w for w in recwarn if "configure_optimizers` will be overridden" in str(w.message)]
    out = capsys.readouterr().out
    assert "Run directory: runs/" in out
    run_dirs = list((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 1
    saved = yaml.safe_load((run_dirs[0] / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 2
    assert saved["model"]["class_path"] == yaml.safe_load(config.read_text())["model"]["class_path"]


@pytest.mark.multiprocess
def test_the_overlays_the_shared_runs_train_ran_from_their_files(strategy_runs):
    for name in sorted(TRAINED_BY_SHARED_RUNS):
        overlay = CONFIGS / "strategies" / f"{name}.yaml"
        assert overlay in OVERLAYS
        saved = yaml.safe_load((strategy_runs[name].run_dir / "config.yaml").read_text())
        wanted = yaml.safe_load(overlay.read_text())["trainer"]["strategy"]
        assert saved["trainer"]["strategy"]["class_path"] == wanted["class_path"], name
        assert len(strategy_runs[name].records) == 2, f"{name}: both ranks trained"


def test_every_strategy_overlay_is_trained_from_its_file_by_some_test():
    # A new overlay needs a test that trains it; a name left here after its file went is stale.
    trained = TRAINED_BY_SHARED_RUNS | TRAINED_BY_TP_TESTS | TRAINED_BY_PP_TESTS | TRAINED_BY_OTHER_TESTS
    assert {overlay.stem for overlay in OVERLAYS} == trained
