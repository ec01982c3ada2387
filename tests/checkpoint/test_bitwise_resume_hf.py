"""A one-process resume of a Hugging Face Llama is bitwise, as our demos' are (issue 58, point 5).

A relaunched Llama run drifted from the uninterrupted one by an ulp from its first step on, although the
checkpoint, the data and the first losses were identical. The cause was no checkpointed state: PerformanceMonitor
counts FLOPs on the first batch of every fit, under torch's ``FlopCounterMode``, which ran each op it saw through
the op's CompositeImplicitAutograd decomposition where one exists, even for an op with a kernel of its own. Llama's
MLP (SiLU) has one, ``silu_backward``, whose decomposition rounds otherwise: the counted batch's gradients differed
in the last bit from an uncounted one. The uninterrupted run counts step 0; a resumed run counted its first step
after the checkpoint, which the uninterrupted run had computed uncounted. Our GPT demo (GELU) and the quickstart
have no such op, so they resumed bitwise. Counting now runs every op as it runs uncounted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_mlopt.callbacks import FaultTolerantCheckpoint, PerformanceMonitor, SaveOn
from lightning_mlopt.demos import TokenDataModule
from lightning_mlopt.perf.flops import TrainingFlopCounter
from tests.support.user_models import HFCausalLM


def _gradients(model: torch.nn.Module, tokens: torch.Tensor, counted: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if counted:
        with TrainingFlopCounter() as counter:
            model.pipeline_loss(model(tokens), tokens).backward()  # type: ignore[operator]
        assert counter.total > 0
    else:
        model.pipeline_loss(model(tokens), tokens).backward()  # type: ignore[operator]
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}  # type: ignore[union-attr]


def test_counting_flops_leaves_a_llamas_gradients_bitwise_unchanged():
    torch.manual_seed(0)
    model = HFCausalLM()
    tokens = torch.randint(0, 256, (4, 32))
    plain = _gradients(model, tokens, counted=False)
    counted = _gradients(model, tokens, counted=True)
    differ = [name for name in plain if not torch.equal(plain[name], counted[name])]
    assert not differ, f"gradients computed under the FLOP counter differ: {differ[:3]}"
    # The SiLU backward is where the decomposition used to round otherwise; it is counted as zero FLOPs, as before.
    grad, gate = torch.randn(4096), torch.randn(4096)
    with TrainingFlopCounter() as counter:
        under = torch.ops.aten.silu_backward(grad, gate)
    assert torch.equal(under, torch.ops.aten.silu_backward(grad, gate)) and counter.total == 0


def _fit(tmp_path: Path, folder: str, steps: int, **settings: Any) -> dict[str, torch.Tensor]:
    pl.seed_everything(1234)
    model = HFCausalLM()
    data = TokenDataModule(vocab_size=256, block_size=64, num_sequences=128, branching=4, batch_size=8)
    checkpoint = FaultTolerantCheckpoint(dirpath=str(tmp_path / folder), every_n_steps=2, async_save=False, **settings)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path / folder,
        callbacks=[checkpoint, PerformanceMonitor(measure_peak=False)],
    )  # fmt: skip
    trainer.fit(model, data)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_a_tiny_llama_resumed_from_its_checkpoint_folder_ends_bitwise_equal_to_the_uninterrupted_run(tmp_path):
    expected = _fit(tmp_path, "uninterrupted", 4)
    # Stopped at step 2 without a final save, as a kill right after the step-2 commit leaves the folder.
    _fit(tmp_path, "resumed", 2, save_on=SaveOn(train_end=False))
    actual = _fit(tmp_path, "resumed", 4)  # resumes from step 2: a fresh PerformanceMonitor counts step 3
    differ = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not differ, f"{len(differ)} tensors differ from the uninterrupted run, first {differ[:3]}"
