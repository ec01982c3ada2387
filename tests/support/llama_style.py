"""A small Llama-shaped causal LM with Hugging Face's module names, for the tensor-parallel plan tests.

Its names are those of ``transformers``' Llama (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj`` ...
``o_proj``, ``mlp.gate_proj``/``up_proj``/``down_proj``, ``model.norm``, ``lm_head``), with grouped-query
attention (fewer key/value heads than query heads) and SwiGLU, and it counts heads from the width it holds,
as ``transformers`` does. It stands in for a model nobody here wrote: the HF overlay's globs must find it.

Also :class:`FixedHeadsGPT`: a model that is not tensor-parallel-correct in a way no static check sees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from torch import Tensor, nn

from lightning_mlopt.demos import GPTLanguageModel
from lightning_mlopt.demos.gpt import CausalSelfAttention
from tests.conftest import CONFIGS


class _Attention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.num_attention_heads, self.num_key_value_heads = num_heads, num_kv_heads
        self.head_dim = d_model // num_heads
        self.q_proj = nn.Linear(d_model, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, _ = x.shape
        q, k, v = (
            projection(x).view(batch, time, -1, self.head_dim).transpose(1, 2)
            for projection in (self.q_proj, self.k_proj, self.v_proj)
        )
        repeat = q.shape[1] // k.shape[1]  # query heads per key/value head, from the local widths
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, time, -1))


class _MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(d_model)
        self.self_attn = _Attention(d_model, num_heads, num_kv_heads)
        self.post_attention_layernorm = nn.RMSNorm(d_model)
        self.mlp = _MLP(d_model, 2 * d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_layer: int, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(_Layer(d_model, num_heads, num_kv_heads) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d_model)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaStyleLM(pl.LightningModule):
    """``model`` (the decoder) and ``lm_head``, as ``LlamaForCausalLM`` names them; AdamW at a fixed rate."""

    def __init__(
        self, vocab_size: int = 256, d_model: int = 64, n_layer: int = 2, num_heads: int = 4, num_kv_heads: int = 2
    ) -> None:
        super().__init__()
        self.model = _Decoder(vocab_size, d_model, n_layer, num_heads, num_kv_heads)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.lm_head(self.model(tokens))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = nn.functional.cross_entropy(self(inputs).flatten(0, 1).float(), targets.flatten())
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _FixedHeadsAttention(CausalSelfAttention):
    """The GPT demo's attention as it was before it was made tensor-parallel-correct: a ``[q; k; v]`` fused
    projection and a fixed head count in ``view``. Split column-wise, rank 0 holds all of q and half of k, and
    the view makes heads of the wrong width: it trains, silently wrong, and every static check passes."""

    def forward(self, x: Tensor) -> Tensor:
        batch, time, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (t.reshape(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, time, -1))


class FixedHeadsGPT(GPTLanguageModel):
    """The GPT demo with :class:`_FixedHeadsAttention`, whose ``tp_plan`` passes the check and is still wrong."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for layer in self.model.layers:
            layer.attn.__class__ = _FixedHeadsAttention


class PipelinedLlamaStyleLM(LlamaStyleLM):
    """:class:`LlamaStyleLM` with the one method pipeline parallelism asks of a model: a micro-batch's loss."""

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1).float(), target.flatten())


def write_llama_config(folder: Path, class_path: str = "tests.support.llama_style.LlamaStyleLM") -> str:
    """A config file in ``folder`` training ``class_path`` (2 layers) on the GPT demo's data, clipping at 0.05."""
    config = {
        "seed_everything": 1234,
        "model": {"class_path": class_path, "init_args": {"n_layer": 2}},
        "data": yaml.safe_load((CONFIGS / "gpt.yaml").read_text())["data"],
        "trainer": {"gradient_clip_val": 0.05},
    }
    (folder / "llama.yaml").write_text(yaml.safe_dump(config))
    return str(folder / "llama.yaml")
