"""The models users bring, through the CLI under every layout: each reaches the one-process result.

Tiny Hugging Face models built from their configs (``tests/support/user_models.py``: Llama with grouped-query
attention and a non-persistent rotary buffer, Qwen2 with q/k/v biases and sliding-window attention, GPT-2 with
``Conv1D``) and a nanoGPT whose blocks sit in a ``ModuleList`` that is a direct child of the LightningModule.
Nobody here wrote these shapes; each broke something our demos never show (issue 58). HSDP with compiled decoder
layers (the Llama), and float8 with compiled blocks under FSDP (the nanoGPT, against one float8 process), too.

Data-parallel layouts run 2 ranks at batch 4 (a global batch of 8; HSDP 2 x 2 ranks at batch 2), tensor and
pipeline layouts one data rank at batch 8: every run sees the samples the one-process run at batch 8 sees (one
process reads the same global order as DistributedSampler), so the mean of the ranks' losses is the one-process
loss. Tolerances as in ``test_strategy_equivalence.py``: fp32 sums in other orders.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mlopt.checkpoint.store import CheckpointStore
from lightning_mlopt.strategies.fsdp_units import root_units
from tests.conftest import CONFIGS
from tests.support.strategy_runs import TrainedRun, train
from tests.support.user_models import HFCausalLM, NanoGPT, llama, nanogpt, write_user_config

STEPS = 6
DATA_PARALLEL = ("--data.init_args.batch_size=4",)
WRAP = "--trainer.strategy.init_args.wrap_classes="
LLAMA_LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
GPT2_BLOCK = "transformers.models.gpt2.modeling_gpt2.GPT2Block"
TP2 = "--trainer.strategy.init_args.tensor_parallel_size=2"
HSDP = ("--trainer.strategy.init_args.replicate_size=2", "--data.init_args.batch_size=2")  # 2 x 2 ranks, batch 8
COMPILED = ("--config", str(CONFIGS / "features" / "compile.yaml"), "--compile.backend=aot_eager")
FLOAT8 = ("--config", str(CONFIGS / "features" / "float8.yaml"))
NANO_TP_PLAN = (
    "--trainer.strategy.init_args.tp_plan={'layers.*.c_fc': colwise, 'layers.*.mlp_proj': rowwise}",
    "--trainer.strategy.init_args.wrap_classes=[]",
)


def _mean_losses(run: TrainedRun) -> torch.Tensor:
    """Each step's loss of the whole job: the mean over data ranks (every rank's, where all hold the same)."""
    return torch.tensor([record["losses"] for record in run.records]).mean(dim=0)


def _assert_reaches(run: TrainedRun, one: TrainedRun, rtol: float = 1e-4, atol: float = 1e-4) -> None:
    torch.testing.assert_close(_mean_losses(run), torch.tensor(one.records[0]["losses"]), rtol=rtol, atol=0)
    assert run.params.keys() == one.params.keys()
    for name, value in one.params.items():
        torch.testing.assert_close(run.params[name], value, rtol=0, atol=atol, msg=name)
    losses = one.records[0]["losses"]
    assert losses[-1] < losses[0], "the reference trained: agreeing on doing nothing proves nothing"


def _checkpointed_names(run: TrainedRun) -> set[str]:
    """The model tensor names the run's final checkpoint holds, whatever its layout (one file or DCP shards)."""
    from torch.distributed.checkpoint import FileSystemReader

    step, folder = CheckpointStore(run.run_dir / "checkpoints").committed()[-1]
    assert step == STEPS
    for metadata in folder.rglob(".metadata"):  # DCP shards: the names, without reading a tensor
        keys = FileSystemReader(str(metadata.parent)).read_metadata().state_dict_metadata
        return {key.removeprefix("state_dict.") for key in keys if key.startswith("state_dict.")}
    names: set[str] = set()
    for path in folder.rglob("*.pt*"):  # DeepSpeed's model states (a ZeRO folder is named state.ckpt)
        if not path.is_file():
            continue
        state = torch.load(path, map_location="cpu", weights_only=False)
        if isinstance(state, dict):
            for key in ("state_dict", "module"):
                names |= {name.removeprefix("_forward_module.") for name in state.get(key) or {}}
    for path in folder.rglob("*.ckpt"):  # one file
        if not path.is_file():
            continue
        names |= set(torch.load(path, map_location="cpu", weights_only=False).get("state_dict") or {})
    return names


class _Runs(dict[str, TrainedRun]):
    """Runs trained on first use, once per module: a test selected alone launches only what it reads."""

    def __init__(self, root: Path, recipes: dict[str, tuple[str, int, tuple[str, ...]]]) -> None:
        super().__init__()
        self.root, self.recipes = root, recipes

    def __missing__(self, name: str) -> TrainedRun:
        strategy, devices, extra = self.recipes[name]
        self[name] = train(self.root, name, strategy, STEPS, devices=devices, extra=extra)
        return self[name]


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    root = tmp_path_factory.mktemp("llama")
    config = ("--config", write_user_config(root, llama(), "llama.yaml"))
    split = ("--trainer.strategy.init_args.split_points=[model.model.layers.1]",
             "--trainer.strategy.init_args.microbatches=4")  # fmt: skip
    return _Runs(root, {
        "one": ("ddp", 1, config),
        "ddp": ("ddp", 2, (*config, *DATA_PARALLEL)),
        "fsdp": ("fsdp", 2, (*config, *DATA_PARALLEL, f"{WRAP}[{LLAMA_LAYER}]")),
        "zero2": ("zero2", 2, (*config, *DATA_PARALLEL)),
        "tp": ("tp_hf", 2, (*config, TP2)),
        "pp": ("pp", 2, (*config, *split)),
        # HSDP (2 replicas x 2 shards) with each decoder layer compiled (found as model.model.layers' members).
        "hsdp_compiled": ("fsdp", 4, (*config, *HSDP, f"{WRAP}[{LLAMA_LAYER}]", *COMPILED)),
    })  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "zero2", "tp", "pp", "hsdp_compiled"])
def test_a_hugging_face_llama_reaches_the_one_process_result(llama_runs, layout):
    _assert_reaches(llama_runs[layout], llama_runs["one"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["one", "fsdp", "zero2", "tp", "pp"])
def test_no_layout_writes_the_non_persistent_rotary_buffer_into_its_checkpoint(llama_runs, layout):
    names = _checkpointed_names(llama_runs[layout])
    assert names == set(HFCausalLM().state_dict()), sorted(names ^ set(HFCausalLM().state_dict()))
    assert not [name for name in names if "rotary_emb" in name]


@pytest.mark.multiprocess
def test_a_pipeline_checkpoint_of_the_hugging_face_model_trains_on_in_one_process(tmp_path, llama_runs):
    # Its final checkpoint: it held the traced stages' rotary buffer, which the strict load refused.
    config = ("--config", write_user_config(tmp_path, llama(), "llama.yaml"))
    checkpoints = f"--ckpt_path={llama_runs['pp'].run_dir / 'checkpoints'}"
    run = train(tmp_path, "on", "ddp", STEPS + 2, devices=1, extra=(*config, checkpoints,
                "--checkpoint.resume.final=true"))  # fmt: skip
    assert len(run.records[0]["losses"]) == 2
    assert run.records[0]["losses"][-1] < llama_runs["one"].records[0]["losses"][0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_other_hugging_face_families_reach_the_one_process_result(tmp_path, family):
    config = ("--config", write_user_config(tmp_path, llama(family=family), f"{family}.yaml"))
    one = train(tmp_path, "one", "ddp", STEPS, devices=1, extra=config)
    if family == "qwen2":  # q/k/v biases split with their weights; sliding-window attention on one rank's heads
        run = train(
            tmp_path, "tp", "tp_hf", STEPS, extra=(*config, "--trainer.strategy.init_args.tensor_parallel_size=2")
        )
    else:  # Conv1D and a fused c_attn: FSDP needs no plan (tensor parallelism refuses Conv1D, test_tp_plan_hf.py)
        run = train(tmp_path, "fsdp", "fsdp", STEPS, extra=(*config, *DATA_PARALLEL, f"{WRAP}[{GPT2_BLOCK}]"))
    _assert_reaches(run, one)


@pytest.fixture(scope="module")
def nano_runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    root = tmp_path_factory.mktemp("nano")
    config = ("--config", write_user_config(root, nanogpt(n_layer=2, d_model=64), "nano.yaml"))
    split = ("--trainer.strategy.init_args.split_points=[layers.1]", "--trainer.strategy.init_args.microbatches=4")
    return _Runs(root, {
        "one": ("ddp", 1, config),
        # No wrap_classes: the ModuleList at the root is looked through, each block its own unit.
        "fsdp": ("fsdp", 2, (*config, *DATA_PARALLEL, f"{WRAP}[]")),
        "fsdp_tp": ("fsdp_tp", 4, (*config, *DATA_PARALLEL, *NANO_TP_PLAN)),
        "pp": ("pp", 2, (*config, *split)),
        # float8 (emulated) on every block linear, the blocks compiled, under FSDP; against DDP in float8 (float8
        # scales activations by their amax over each rank's batch: the same local batches, the same scales).
        "ddp_float8": ("ddp", 2, (*config, *DATA_PARALLEL, *FLOAT8)),
        "fsdp_float8_compiled": ("fsdp", 2, (*config, *DATA_PARALLEL, f"{WRAP}[]", *FLOAT8, *COMPILED)),
    })  # fmt: skip


@pytest.mark.multiprocess
def test_a_nanogpt_in_float8_with_compiled_blocks_under_fsdp_trains_as_float8_ddp_does(nano_runs):
    run = nano_runs["fsdp_float8_compiled"]
    said = (run.run_dir.parent.parent / "fsdp_float8_compiled" / "output.txt").read_text()
    assert "torch.compile (aot_eager): 2 block region(s) (layers.0, ...)" in said
    assert "8 linear layer(s) (layers.0.c_attn, ...); kept in high precision: lm_head (the output head)" in said
    # FSDP's float8 weights are cast with the amax of the whole tensor, as DDP's: sums in another order alone.
    # FSDP's float8 weights are cast with the amax of the whole tensor, as DDP's, and each rank's activations with
    # its own batch's, as DDP's: the same numbers (equal to the bit here; allowed sums in another order).
    ddp = nano_runs["ddp_float8"]
    torch.testing.assert_close(_mean_losses(run), _mean_losses(ddp), rtol=1e-5, atol=0)
    for name, value in ddp.params.items():
        torch.testing.assert_close(run.params[name], value, rtol=0, atol=1e-5, msg=name)
    # And float8 trains near eager fp32 (not equal: each matmul's inputs are rounded to float8).
    torch.testing.assert_close(_mean_losses(run), _mean_losses(nano_runs["one"]), rtol=2e-2, atol=0)
    assert _checkpointed_names(run) == set(NanoGPT().state_dict()), "eager names, no float8 or compile prefixes"


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp", "pp"])
def test_a_nanogpt_with_its_blocks_in_a_root_module_list_reaches_the_one_process_result(nano_runs, layout):
    run = nano_runs[layout]
    _assert_reaches(run, nano_runs["one"])
    # nanoGPT's causal mask is a non-persistent buffer named `bias`, beside the Linears' biases.
    assert _checkpointed_names(run) == set(NanoGPT().state_dict())


def test_fsdp_looks_through_containers_at_the_root_for_its_units():
    units = [type(unit).__name__ for unit in root_units(NanoGPT(n_layer=3))]
    assert units == ["Embedding", "Embedding", "_NanoBlock", "_NanoBlock", "_NanoBlock", "LayerNorm", "Linear"]
