"""The CLI's contract: run directories, resolved configs, short strategy names, --print_config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_mlopt import strategies
from lightning_mlopt.cli import main
from lightning_mlopt.run_dir import config_fingerprint, default_run_dir
from tests.conftest import CONFIGS, SMOKE

QUICKSTART = str(CONFIGS / "quickstart.yaml")


def _fit(*args: str) -> None:
    main(["fit", "--config", QUICKSTART, *SMOKE, *args])


def test_run_dir_is_stable_across_relaunches_and_differs_between_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fit()
    first = sorted((tmp_path / "runs").iterdir())
    _fit()  # the identical command again
    assert sorted((tmp_path / "runs").iterdir()) == first
    _fit("--model.init_args.lr=0.01")
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    changed = next(path for path in runs if path not in first)
    assert yaml.safe_load((changed / "config.yaml").read_text())["model"]["init_args"]["lr"] == 0.01


def test_run_dir_and_default_root_dir_are_honoured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fit("--run_dir=mine")
    assert (tmp_path / "mine" / "config.yaml").is_file()
    _fit("--trainer.default_root_dir=elsewhere")
    (run,) = (tmp_path / "elsewhere").iterdir()
    assert run.name.startswith("quickstart-")


def test_validate_writes_its_own_config_next_to_fit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fit()
    main(
        [
            "validate",
            "--config",
            QUICKSTART,
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
        ]
    )
    names = {p.name for p in (tmp_path / "runs").rglob("config*.yaml")}
    assert names == {"config.yaml", "config.validate.yaml"}


def test_short_strategy_name_resolves_to_ours(tmp_path, monkeypatch):
    assert strategies.resolve_strategy("ddp") == "mlopt_ddp"
    assert strategies.resolve_strategy("single_device") == "single_device"
    assert strategies.resolve_strategy("auto") == "auto"
    with pytest.raises(ValueError, match="unknown strategy 'fsdpp'"):
        strategies.resolve_strategy("fsdpp")


def test_print_config_prints_the_composed_config_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    overlay = CONFIGS / "strategies" / "ddp.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--config", str(overlay), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] == "lightning_mlopt.demos.ResNetClassifier"
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_mlopt.strategies.DDPStrategy"
    assert not (tmp_path / "runs").exists()


def test_fingerprint_ignores_launch_details_only():
    config = {"model": {"lr": 0.1}, "config": ["a.yaml"], "ckpt_path": None}
    assert config_fingerprint(config) == config_fingerprint({**config, "config": ["/elsewhere/a.yaml"]})
    assert config_fingerprint(config) != config_fingerprint({**config, "model": {"lr": 0.2}})
    path = default_run_dir("runs", ["configs/gpt.yaml", "configs/strategies/zero2.yaml"], config)
    assert path.parent == Path("runs") and path.name.startswith("gpt-zero2-")


def test_quickstart_learns(tmp_path, monkeypatch, capsys):
    """The README's first command: the quickstart ends well above chance (0.10) and says so."""
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", QUICKSTART, "--trainer.enable_progress_bar=false"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("Final validation metrics:"))
    accuracy = float(line.split("val/acc=")[1].split()[0])
    assert accuracy > 0.8, line


def test_without_a_subcommand_every_subcommand_is_named_and_help_lists_the_tools(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "name a subcommand: fit, validate, test, predict, plan, checkpoint, sweep, slurm" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(f"  {tool}" in out for tool in ("plan", "checkpoint", "sweep", "slurm")) and "{fit,validate" in out
