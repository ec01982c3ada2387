"""The CLI's contract: run directories, resolved configs, short strategy names, --print_config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from lightning_mlopt import strategies
from lightning_mlopt.cli import main
from lightning_mlopt.run_dir import config_fingerprint, default_run_dir
from tests.conftest import CONFIGS, SMOKE, run_cli

QUICKSTART = str(CONFIGS / "quickstart.yaml")


def _fit(*args: str) -> None:
    main(["fit", "--config", QUICKSTART, *SMOKE, *args])


@pytest.mark.slow
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


@pytest.mark.slow
def test_run_dir_and_default_root_dir_are_honoured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fit("--run_dir=mine")
    assert (tmp_path / "mine" / "config.yaml").is_file()
    _fit("--trainer.default_root_dir=elsewhere")
    (run,) = (tmp_path / "elsewhere").iterdir()
    assert run.name.startswith("quickstart-")


@pytest.mark.slow
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


@pytest.mark.slow
def test_our_loggers_may_be_named_by_class_name_alone(tmp_path):
    # A fresh process: lightning_mlopt.tracking imports its classes lazily, and the parser finds a short name only
    # among the classes imported (the CLI imports our loggers for that).
    result = run_cli(["fit", "--config", QUICKSTART, "--trainer.logger=WandbTracker", "--print_config"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert yaml.safe_load(result.stdout)["trainer"]["logger"]["class_path"] == "lightning_mlopt.tracking.WandbTracker"


def test_fingerprint_ignores_launch_details_only():
    config = {"model": {"lr": 0.1}, "config": ["a.yaml"], "ckpt_path": None}
    assert config_fingerprint(config) == config_fingerprint({**config, "config": ["/elsewhere/a.yaml"]})
    assert config_fingerprint(config) != config_fingerprint({**config, "model": {"lr": 0.2}})
    path = default_run_dir("runs", ["configs/gpt.yaml", "configs/strategies/zero2.yaml"], config)
    assert path.parent == Path("runs") and path.name.startswith("gpt-zero2-")


@pytest.mark.slow
@pytest.mark.solo  # its data-wait fraction is measured: another worker beside it skews it
def test_quickstart_learns_and_says_only_what_a_user_can_act_on(tmp_path):
    """The README's first command: the quickstart ends well above chance (0.10) and says so, without noise."""
    result = run_cli(["fit", "--config", QUICKSTART], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = (result.stdout + result.stderr).replace("\r", "\n")
    line = next(line for line in output.splitlines() if line.startswith("Final validation metrics:"))
    accuracy = float(line.split("val/acc=")[1].split()[0])
    assert accuracy > 0.8, line
    noise_words = ("Tip:", "litlogger", "weights_only", "LeafSpec", "tensorboardX", "srun", "unreliable results")
    for noise in (*noise_words, "input-stalled"):  # our own demo feeds its steps in time (issue 27)
        assert noise not in output, f"noise in the quickstart's output: {noise!r}\n{output[-3000:]}"
    assert len([line for line in output.splitlines() if line.strip()]) <= 30, output


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


@pytest.mark.slow
def test_relaunching_from_the_saved_or_printed_config_lands_in_the_same_run(tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.chdir(tmp_path)
    # A user's own model and config file (no datamodule: the model brings its dataloaders).
    (tmp_path / "lm.yaml").write_text(
        "model:\n  class_path: tests.support.models.ThirdPartyLM\ntrainer:\n  limit_val_batches: 1\n"
        "  val_check_interval: 2\n  num_sanity_val_steps: 0\n  enable_progress_bar: false\n"
    )
    first_args = ["fit", "--config", "lm.yaml", "--trainer.max_steps=2"]
    main(first_args)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("lm-")
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["run_dir"] == str(run_dir)
    first = json.loads((run_dir / "metrics.json").read_text())["metrics"]
    assert "val_loss" in first

    # The printed config names the run directory too (it said `run_dir: null`), so a file saved from it...
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*first_args, "--print_config"])
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["run_dir"] == str(run_dir)
    (tmp_path / "printed.yaml").write_text(printed)
    # ... and the saved config.yaml, relaunched with more steps and no validation, continue the same run.
    relaunch = [
        "fit",
        "--config",
        str(run_dir / "config.yaml"),
        "--trainer.max_steps=4",
        "--trainer.limit_val_batches=0",
    ]
    main(relaunch)  # the run finished at step 2 (marked final): it stays finished, and says how to go on
    assert "set checkpoint.resume.final: true" in caplog.text
    main([*relaunch, "--checkpoint.resume.final=true"])
    assert list((tmp_path / "runs").iterdir()) == [run_dir], "no second run directory"
    # The relaunch's settings replace config.yaml; what the run was is kept (one copy: the same settings add none).
    assert [p.name for p in (run_dir / "earlier_configs").iterdir()] == ["1-config.yaml"]
    assert yaml.safe_load((run_dir / "earlier_configs" / "1-config.yaml").read_text())["trainer"]["max_steps"] == 2
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["max_steps"] == 4
    assert (run_dir / "checkpoints" / "step-000000004").is_dir()
    merged = json.loads((run_dir / "metrics.json").read_text())
    assert merged["global_step"] == 4
    assert merged["metrics"]["val_loss"] == first["val_loss"], "what the run logged before the relaunch is kept"
    main(["fit", "--config", "printed.yaml", "--trainer.max_steps=4"])  # finished: marked final, nothing new
    assert list((tmp_path / "runs").iterdir()) == [run_dir]


@pytest.mark.multiprocess
def test_strategy_auto_trains_exactly_the_run_of_the_strategy_it_chose(tmp_path):
    from tests.support.recorders import read_records

    common = [
        "fit",
        "--model=tests.support.models.ThirdPartyLM",  # dropout 0.1: the RNG state shows in the losses
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.max_steps=3",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.logger=false",
    ]
    records = {}
    for strategy in ("auto", "ddp"):
        out = tmp_path / strategy
        result = run_cli(
            [
                *common,
                # auto by its overlay file, which test_configs.py leaves to this test
                *(
                    ["--config", str(CONFIGS / "strategies" / "auto.yaml")]
                    if strategy == "auto"
                    else ["--trainer.strategy=ddp"]
                ),
                f"--run_dir={out}",
                "--trainer.callbacks+=tests.support.recorders.RecordTraining",
                f"--trainer.callbacks.out_dir={out / 'record'}",
            ],
            cwd=tmp_path,
            preloaded=True,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        records[strategy] = read_records(out / "record")
    assert (
        "strategy: auto chose ddp" in result.stdout + result.stderr or records["auto"][0]["strategy"] == "DDPStrategy"
    )
    assert [r["losses"] for r in records["auto"]] == [r["losses"] for r in records["ddp"]]


@pytest.mark.slow
def test_a_relaunch_of_a_finished_run_trains_nothing_and_makes_no_log_folder(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    _fit("--run_dir=run")
    assert [p.name for p in (tmp_path / "run" / "lightning_logs").iterdir()] == ["version_0"]
    metrics = (tmp_path / "run" / "metrics.json").read_text()
    _fit("--run_dir=run", "--trainer.max_steps=4")  # finished at step 2 (marked final): not trained again
    assert "is marked final: this run already finished at step 2; not training again" in caplog.text
    assert [p.name for p in (tmp_path / "run" / "lightning_logs").iterdir()] == ["version_0"], "no version_1"
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")] == ["step-000000002"]
    assert (tmp_path / "run" / "metrics.json").read_text() == metrics


@pytest.mark.slow
def test_an_optimizer_and_scheduler_from_yaml_replace_a_demos_default_without_a_warning(
    tmp_path, monkeypatch, recwarn, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adam.yaml").write_text(
        "optimizer:\n  class_path: torch.optim.Adam\n  init_args: {lr: 0.002, weight_decay: 0.0001}\n"
        "lr_scheduler:\n  class_path: torch.optim.lr_scheduler.StepLR\n  init_args: {step_size: 1, gamma: 0.5}\n"
    )
    _fit("--config", "adam.yaml", "--run_dir=run", "--model.init_args.lr=0.1")
    overridden = [str(w.message) for w in recwarn if "configure_optimizers` will be overridden" in str(w.message)]
    assert overridden == [], "the demo's SGD is a default, replaced as the config asks"
    out = capsys.readouterr().out
    assert "Not used: model.init_args.lr=0.1: the config's optimizer (torch.optim.Adam) replaces" in out
    state = torch.load(next((tmp_path / "run" / "checkpoints").glob("step-*/state.ckpt")), weights_only=False)
    (group,) = state["optimizer_states"][0]["param_groups"]
    assert "betas" in group and group["initial_lr"] == 0.002 and group["weight_decay"] == 0.0001  # Adam's
    (scheduler,) = state["lr_schedulers"]
    assert scheduler["step_size"] == 1 and scheduler["gamma"] == 0.5  # StepLR, stepped once per epoch


def test_the_model_summary_has_flops_only_where_they_were_measured(caplog):
    import logging

    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_mlopt.cli.support import MeasuredModelSummary

    class WithExampleInput(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.example_input_array = torch.zeros(4, 32)

    tables = []
    for model in (BoringModel(), WithExampleInput()):
        caplog.clear()
        trainer = Trainer(
            max_steps=1,
            callbacks=[MeasuredModelSummary()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            limit_val_batches=0,
        )
        with caplog.at_level(logging.INFO):
            trainer.fit(model)
        tables.append(next(record.getMessage() for record in caplog.records if "Trainable params" in record.message))
    unmeasured, measured = tables
    assert "FLOPs" not in unmeasured and "Total Flops" not in unmeasured  # not a column of zeros
    assert "| Params | Mode  | FLOPs" in measured
    flops = next(line for line in measured.splitlines() if line.endswith("Total Flops"))
    assert flops.split()[0] == "512"  # a 32 -> 2 linear layer on 4 samples: 2 FLOPs x 4 x 32 x 2 multiply-adds


def test_a_relaunch_with_other_settings_keeps_the_earlier_config(tmp_path):
    from lightning_mlopt.run_dir import keep_earlier_config

    config = tmp_path / "config.yaml"
    for number, text in enumerate(["max_steps: 2\n", "max_steps: 2\n", "max_steps: 4\n", "max_steps: 8\n"]):
        new = tmp_path / f".config.yaml.new{number}"
        new.write_text(text)
        keep_earlier_config(config, new)
    assert config.read_text() == "max_steps: 8\n"
    earlier = tmp_path / "earlier_configs"
    assert sorted(p.name for p in earlier.iterdir()) == ["1-config.yaml", "2-config.yaml"]  # the same text: no copy
    assert [(earlier / f"{n}-config.yaml").read_text() for n in (1, 2)] == ["max_steps: 2\n", "max_steps: 4\n"]
    (earlier / "1-config.yaml").unlink()  # one removed by hand: the next is numbered after the highest, not over it
    new = tmp_path / ".config.yaml.new9"
    new.write_text("max_steps: 16\n")
    assert keep_earlier_config(config, new) == earlier / "3-config.yaml"
    assert (earlier / "2-config.yaml").read_text() == "max_steps: 4\n"


def test_a_launch_builds_the_parser_of_its_subcommand_alone_and_help_lists_them_all(capsys):
    # Each subcommand's parser costs every rank ~0.2 s of start-up: fit, validate, test and predict were all built.
    from lightning_mlopt.cli.entry import MLOptCLI

    cli = MLOptCLI.__new__(MLOptCLI)  # the method alone: building the CLI would run the subcommand
    cli._launched = "validate"
    assert list(cli.subcommands()) == ["validate"]
    cli._launched = None  # --help, or options before the subcommand
    assert list(cli.subcommands()) == ["fit", "validate", "test", "predict"]
    with pytest.raises(SystemExit) as ended:
        main(["--help"])
    assert ended.value.code == 0
    shown = capsys.readouterr()
    assert "{fit,validate,test,predict}" in shown.out + shown.err, shown
