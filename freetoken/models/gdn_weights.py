"""Weights of one decoder layer of a Gated DeltaNet (GDN) model (Qwen3-Next, Qwen3.5/3.6-MoE).

Layout of the arrays the model (models/qwen3_next.py) reads; the HF loader (models/hf_gdn.py) and
the synthetic generator (models/synth.py) both produce it. bf16 travels as uint16; A_log and
dt_bias are always float32 (they feed an exp and a softplus). RMSNorm weights are stored as the
factor the model multiplies by: the checkpoint's (1 + w) for the Gemma-style norms.
Shape legend: H hidden, Hq query heads, G kv heads, D head dim, Hk / Hv GDN key / value heads,
Dk / Dv their dims, C = 2*Hk*Dk + Hv*Dv conv channels, K conv kernel, E experts, I expert width,
Is shared-expert width.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class GdnLayerWeights:
    input_norm: np.ndarray              # [H]
    post_norm: np.ndarray               # [H]
    # gated full attention (None on GDN layers)
    qkv: np.ndarray | None = None       # [2*Hq*D + 2*G*D, H]: per head [query D | gate D], then k, then v
    o_proj: np.ndarray | None = None    # [H, Hq*D]
    q_norm: np.ndarray | None = None    # [D]
    k_norm: np.ndarray | None = None    # [D]
    # Gated DeltaNet (None on attention layers)
    in_proj: np.ndarray | None = None   # [C + Hv*Dv + 2*Hv, H]: rows q, k, v (the conv's C) | z | b | a
    conv: np.ndarray | None = None      # [C, K]
    A_log: np.ndarray | None = None     # f32[Hv]
    dt_bias: np.ndarray | None = None   # f32[Hv]
    gdn_norm: np.ndarray | None = None  # [Dv] (used as stored: no 1 + w)
    out_proj: np.ndarray | None = None  # [H, Hv*Dv]
    # MLP: routed experts (router not None) or a dense SwiGLU as a one-expert bank
    router: np.ndarray | None = None    # [E, H]
    gate_up: np.ndarray | None = None   # [E, 2I, H] gate rows first
    down: np.ndarray | None = None      # [E, H, I]
    shared_gate_up: np.ndarray | None = None  # [1, 2*Is, H]
    shared_down: np.ndarray | None = None     # [1, H, Is]
    shared_gate: np.ndarray | None = None     # [1, H]: sigmoid(h @ shared_gate.T) scales the shared expert

    @property
    def is_linear(self) -> bool:
        return self.in_proj is not None



def gdn_param_count(cfg) -> int:
    """Weights of a hybrid of this config, every expert included (A_log, dt_bias counted as two)."""
    H, V, D, Hq, G = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    Hv, Dv, C, K = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim
    mlp = E * H + 3 * E * I * H + 3 * Is * H + H
    attn = (2 * Hq + 2 * G) * D * H + H * Hq * D + 2 * D
    gdn = (C + Hv * Dv + 2 * Hv) * H + C * K + 2 * Hv + Dv + H * Hv * Dv
    n = sum(2 * H + mlp + (gdn if cfg.is_linear_layer(i) else attn) for i in range(cfg.num_layers))
    return 2 * V * H + H + n
