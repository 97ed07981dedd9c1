"""The decoder-layer pieces EAGLE-3 and DFlash share, with the public checkpoints' parameter names
(`self_attn.q_proj`, `mlp.gate_proj`, ...): projections only; each drafter writes its own forward."""
from __future__ import annotations

import torch.nn as nn


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
