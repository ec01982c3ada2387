"""DeepSpeed and the Trainer never silently disagree: the Trainer wins, and the run says so."""

from __future__ import annotations

import pytest

from tests.conftest import CONFIGS, SMOKE, run_cli


@pytest.mark.multiprocess
def test_trainer_settings_win_and_are_reported(tmp_path):
    overlay = tmp_path / "zero2_custom.yaml"
    overlay.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_mlopt.strategies.DeepSpeedStrategy\n"
        "    init_args:\n      preset: zero2\n      config:\n        gradient_clipping: 5.0\n"
        "        train_micro_batch_size_per_gpu: 99\n        bf16: {enabled: true}\n"
    )
    result = run_cli(
        [
            "fit",
            "--config",
            str(CONFIGS / "gpt.yaml"),
            "--config",
            str(overlay),
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            "--trainer.gradient_clip_val=0.5",
            "--data.init_args.batch_size=8",
            *SMOKE,
        ],
        cwd=tmp_path,
        preloaded=True,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "gradient_clipping=5.0 replaced by 0.5 from trainer.gradient_clip_val" in output
    assert "train_micro_batch_size_per_gpu=99 replaced by 8 from the train DataLoader's batch_size" in output
    assert "bf16.enabled=True replaced by False from trainer.precision='32-true'" in output
    assert "DeepSpeed settings in force: stage=2" in output
    assert "micro_batch=8, accumulation=1, gradient_clipping=0.5, fp16=False, bf16=False" in output
