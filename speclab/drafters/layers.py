"""The decoder-layer pieces the drafters share (EAGLE-3, DFlash, SpecBlock), with the public checkpoints'
parameter names (`self_attn.q_proj`, `mlp.gate_proj`, ...): projections, and the part of a layer after attention;
each drafter writes its own attention."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    """q/k/v/o projections from `d_in` (EAGLE-3 reads [embedding, hidden], 2 x d), optionally with per-head q/k
    RMSNorms (Qwen3, DFlash)."""

    def __init__(self, d_in: int, d_model: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False,
                 qk_norm_eps: float | None = None):
        super().__init__()
        self.q_proj = nn.Linear(d_in, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_in, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_in, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, d_model, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, intermediate, bias=False)
        self.up_proj = nn.Linear(d_model, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, d_model, bias=False)


class DecoderLayer(nn.Module):
    """A Qwen3-style decoder layer (attention with per-head q/k RMSNorms, SwiGLU MLP, pre-norms): DFlash's and
    SpecBlock's. Its forward is written by each drafter except the part after attention (`finish`)."""

    def __init__(self, d_model: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 bias: bool = False):
        super().__init__()
        self.self_attn = Attention(d_model, d_model, heads, kv_heads, head_dim, bias, qk_norm_eps=eps)
        self.mlp = MLP(d_model, intermediate)
        self.input_layernorm = nn.RMSNorm(d_model, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d_model, eps=eps)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of the layer: residual + o_proj(attention output [.., heads, n, D]), then the MLP."""
        x = x + self.self_attn.o_proj(attn.transpose(-2, -3).flatten(-2))
        h = self.post_attention_layernorm(x)
        m = self.mlp
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
