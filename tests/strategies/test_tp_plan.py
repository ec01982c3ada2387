"""The tensor-parallel plan check, alone: globs resolve to module names, and each bad plan is refused with a
message that names the glob or module, the reason and the fix, before any process group exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from torch import nn

from lightning_mlopt.demos import GPTLanguageModel
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies.tensor.tp_plan import STYLES, resolve
from tests.support.llama_style import LlamaStyleLM

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "strategies"


def _gpt(**overrides: int) -> GPTLanguageModel:
    return GPTLanguageModel(
        **{"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4, "d_model": 32, **overrides}
    )


def _overlay_plan(name: str) -> dict[str, str]:
    return yaml.safe_load((CONFIGS / name).read_text())["trainer"]["strategy"]["init_args"]["tp_plan"]


def test_the_demo_plan_resolves_every_glob_to_its_modules_in_model_order():
    plan = resolve(_gpt(), GPTLanguageModel.tp_plan, 2)
    assert list(plan.styles) == [
        "model.token_embedding",
        "model.layers.0.attn.qkv",
        "model.layers.0.attn.proj",
        "model.layers.0.mlp.0",
        "model.layers.0.mlp.2",
        "model.layers.1.attn.qkv",
        "model.layers.1.attn.proj",
        "model.layers.1.mlp.0",
        "model.layers.1.mlp.2",
        "model.lm_head",
    ]
    assert plan.describe()[1] == "model.layers.0.attn.qkv: colwise, out_features 96 -> 48 a rank"
    assert set(plan.parallelize_plan()) == set(plan.styles)
    # The overlays carry the same plan as the model's own.
    assert _overlay_plan("tp.yaml") == _overlay_plan("fsdp_tp.yaml") == GPTLanguageModel.tp_plan


def test_the_hugging_face_overlay_finds_a_llama_shaped_model_wherever_the_module_keeps_it():
    wrapped = nn.ModuleDict({"llm": LlamaStyleLM(n_layer=2)})  # one level deeper than the plan was written for
    plan = resolve(wrapped, _overlay_plan("tp_hf.yaml"), 2)
    assert plan.styles["llm.model.layers.1.self_attn.k_proj"] == "colwise"
    assert plan.styles["llm.model.layers.0.mlp.down_proj"] == "rowwise"
    assert plan.styles["llm.lm_head"] == "colwise_replicated"
    assert plan.styles["llm.model.embed_tokens"] == "embedding_rowwise"
    assert len(plan.styles) == 2 + 2 * 7


@pytest.mark.parametrize(
    ("plan", "size", "model", "expected"),
    [
        (
            {"model.layers.*.attn.qvk": "colwise"},
            2,
            "gpt",
            "tp_plan: 'model.layers.*.attn.qvk' matches no module of the model. Nearest names: model.layers.*.attn.qkv",
        ),
        ({"model.lm_head": "columnwise"}, 2, "gpt", "unknown style 'columnwise'; choose one of colwise, rowwise"),
        (
            {"model.layers.*.ln1": "colwise"},
            2,
            "gpt",
            "model.layers.0.ln1 (LayerNorm) cannot be colwise: that style splits an nn.Linear",
        ),
        ({"model.token_embedding": "rowwise"}, 2, "gpt", "model.token_embedding (Embedding) cannot be rowwise"),
        (
            {"model.layers.*.attn.qkv": "colwise", "model.layers.*.attn.proj": "rowwise"},
            3,
            "gpt",
            # qkv's 96 outputs divide by 3; proj's 32 inputs do not
            "model.layers.0.attn.proj (rowwise) splits in_features=32, which tensor_parallel_size=3 does not divide",
        ),
        (
            {"model.layers.*.mlp.0": "colwise"},
            2,
            "gpt",
            "model.layers.0.mlp.0 is colwise, so its output stays split across ranks, and no rowwise module in "
            "model.layers.0.mlp consumes it",
        ),
        (
            {"model.lm_head": "colwise_replicated", "*head": "colwise"},
            2,
            "gpt",
            "module model.lm_head is colwise_replicated by 'model.lm_head' and colwise by '*head'",
        ),
        (
            {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise", "*.o_proj": "rowwise"},
            4,
            "llama",  # 2 key/value heads cannot be split 4 ways, though every width divides by 4
            "model.layers.0.self_attn.num_key_value_heads=2 does not divide by tensor_parallel_size=4",
        ),
        ({}, 2, "gpt", "tp_plan is empty"),
    ],
    ids=["glob", "style", "class", "embedding", "width", "consumer", "twice", "heads", "empty"],
)
def test_a_bad_plan_is_refused_naming_the_cause(plan, size, model, expected):
    module = _gpt() if model == "gpt" else LlamaStyleLM(d_model=64, num_heads=4, num_kv_heads=2)
    with pytest.raises(BadInputError) as refused:
        resolve(module, plan, size)
    assert expected in str(refused.value)
    assert len(str(refused.value).splitlines()) <= 15


def test_every_style_says_what_it_does():
    # The docs and the messages quote these; an empty one would leave a user guessing.
    assert all(style.description for style in STYLES.values())
    # The styles that split no parameter are sequence parallelism's: a norm on part of the sequence, a gather.
    assert {name for name, style in STYLES.items() if style.split_dimension is None} == {
        "sequence_parallel",
        "gather_sequence",
    }


def test_the_sequence_parallel_overlay_splits_what_tp_splits_and_runs_the_norms_on_part_of_the_sequence():
    model = _gpt()
    sequence = resolve(model, _overlay_plan("tp_sp.yaml"), 2)
    plain = resolve(model, _overlay_plan("tp.yaml"), 2)
    # The same matrices split, plus the position table (split by position): the norms are whole on every rank.
    position_table = model.model.position_embedding.weight.numel()
    assert sequence.split_elements(model) == plain.split_elements(model) + position_table
    assert sequence.styles["model.layers.1.ln2"] == "sequence_parallel"
    assert sequence.styles["model.layers.1.mlp"] == "gather_sequence"
    assert "model.layers.0.ln1: sequence_parallel (a norm or dropout run on this rank's part" in sequence.describe()[2]
    # A row-wise layer that reduce-scatters along the sequence still consumes the column-wise split.
    resolve(model, {"model.layers.*.mlp.0": "colwise", "model.layers.*.mlp.2": "rowwise_sequence"}, 2)
