"""Native Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3) over a flattened batch.

Inputs are `[num_tokens]` ids and positions of many sequences concatenated; attention reads the
per-step `AttentionContext`. Family differences are config switches: q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3) and tied embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.activation import SiluAndMul
from atom.model_ops.attention import Attention
from atom.model_ops.embed_head import ParallelLMHead, VocabParallelEmbedding
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from atom.model_ops.parallel import tp_size
from atom.model_ops.rotary_embedding import RotaryEmbedding


def check_tensor_parallel(cfg, tp: int) -> None:
    """A `ValueError` naming the field when the checkpoint cannot be split over `tp` ranks:
    attention heads and MLP width shard evenly, key/value heads shard or replicate evenly."""
    kv = cfg.num_key_value_heads
    fits = {
        "num_attention_heads": cfg.num_attention_heads % tp == 0,
        "num_key_value_heads": kv % tp == 0 or tp % kv == 0,
        "intermediate_size": cfg.intermediate_size % tp == 0,
    }
    for name, ok in fits.items():
        if not ok:
            raise ValueError(
                f"tensor_parallel_size {tp} does not divide the model's {name} "
                f"({getattr(cfg, name)})"
            )


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        tp = tp_size()
        self.head_dim = head_dim_of(cfg)
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = max(1, cfg.num_key_value_heads // tp)
        bias = getattr(cfg, "attention_bias", cfg.model_type == "qwen2")
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size)
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg, self.head_dim, cfg.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.hidden_act in ("silu", "swish"), f"unsupported activation {cfg.hidden_act}"
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size])
        self.down_proj = RowParallelLinear(size, cfg.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (packed parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [num_tokens, hidden]; the runner picks rows for `compute_logits`."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
