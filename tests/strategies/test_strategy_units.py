"""Strategy construction: knobs, presets, merge rules and errors (single process, no training)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mlopt.demos import GPTLanguageModel
from lightning_mlopt.strategies import (
    STRATEGIES,
    DeepSpeedStrategy,
    FSDPStrategy,
    TensorParallelStrategy,
    resolve_strategy,
)
from lightning_mlopt.strategies.deepspeed.deepspeed_strategy import PRESETS, merge_config
from lightning_mlopt.strategies.fsdp_options import FSDPOptions
from lightning_mlopt.strategies.fsdp_units import select_by_size

BLOCK = "lightning_mlopt.demos.gpt.TransformerBlock"


def test_every_short_name_builds_its_strategy():
    for name, (cls, init_args, _) in STRATEGIES.items():
        assert resolve_strategy(name) == f"mlopt_{name}"
        assert isinstance(cls(**init_args), cls)


def test_fsdp_wrap_class_missing_from_model_lists_the_model_classes():
    strategy = FSDPStrategy(wrap_classes=["torch.nn.Conv2d"])
    with pytest.raises(ValueError, match=r"wrap_classes: torch.nn.modules.conv.Conv2d is not in the model") as error:
        strategy.check_model(GPTLanguageModel(n_layer=1))
    assert BLOCK in str(error.value)
    assert "torch.nn.modules.linear.Linear" in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"wrap_classes": ["no.such.Module"]}, "wrap_classes: cannot import 'no.such.Module'"),
        ({"wrap_classes": ["builtins.dict"]}, "is not a torch.nn.Module class"),
        ({"activation_checkpointing": ["nope"]}, "activation_checkpointing: cannot import"),
        ({"min_params_to_wrap": 0}, "min_params_to_wrap must be >= 1"),
        ({"replicate_size": 0}, "replicate_size must be >= 1"),
        ({"timeout_minutes": 0}, "timeout_minutes must be > 0"),
    ],
)
def test_fsdp_bad_knobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FSDPStrategy(**kwargs)


def test_fsdp_size_policy_wraps_the_largest_subtrees_first():
    model = nn.Sequential(nn.Linear(100, 100), nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)))
    wrapped: set[nn.Module] = set()
    left = select_by_size(model, threshold=1000, wrapped=wrapped, is_root=True)
    assert wrapped == {model[0]}  # 10,100 parameters; the inner Sequential holds only 220
    assert left == 220


def test_fsdp_options_are_one_object_that_tensor_parallelism_takes_whole():
    keys = {
        "wrap_classes": [BLOCK],
        "activation_checkpointing": [BLOCK],
        "param_dtype": "bfloat16",
        "cpu_offload": True,
    }
    fsdp, tp = FSDPStrategy(**keys), TensorParallelStrategy(tensor_parallel_size=2, replicate_size=2, **keys)
    assert fsdp.fsdp_options == tp.fsdp_options
    assert tp.replicate_size == 2
    options = FSDPOptions.from_keys(**keys)
    model = GPTLanguageModel(n_layer=2)
    assert options.units(model) == set(model.model.layers)
    # By size, the largest subtrees first: each MLP (131k parameters), then the stack with the rest of its blocks.
    sized = FSDPOptions(min_params_to_wrap=100_000).units(model)
    assert sized == {model.model.layers, model.model.layers[0].mlp, model.model.layers[1].mlp}
    kwargs = options.fully_shard_kwargs(mesh=None, device_type="cpu")  # type: ignore[arg-type]
    assert kwargs["mp_policy"].param_dtype is torch.bfloat16 and kwargs["mp_policy"].reduce_dtype is torch.bfloat16
    assert type(kwargs["offload_policy"]).__name__ == "CPUOffloadPolicy" and not kwargs["offload_policy"].pin_memory


def test_deepspeed_presets_and_merge():
    assert merge_config({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}, "d": 4}) == {"a": {"b": 1, "c": 3}, "d": 4}
    strategy = DeepSpeedStrategy(preset="zero3", config={"zero_optimization": {"reduce_bucket_size": 1000}})
    zero = strategy.config["zero_optimization"]
    assert (zero["stage"], zero["reduce_bucket_size"], zero["overlap_comm"]) == (3, 1000, True)
    assert strategy.config["zero_allow_untested_optimizer"] is True
    assert PRESETS["zero2"]["zero_optimization"]["stage"] == 2  # the preset itself is not mutated


def test_deepspeed_offload_flags():
    strategy = DeepSpeedStrategy(preset="zero2", offload_optimizer=True)
    assert strategy.config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    off = DeepSpeedStrategy(preset="zero3_offload", offload_parameters=False)
    assert "offload_param" not in off.config["zero_optimization"]
    with pytest.raises(ValueError, match="parameter offload needs ZeRO stage 3"):
        DeepSpeedStrategy(preset="zero2", offload_parameters=True)
    with pytest.raises(ValueError, match="preset must be one of"):
        DeepSpeedStrategy(preset="zero4")  # type: ignore[arg-type]
