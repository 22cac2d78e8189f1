"""gpt-oss forward pass (GptOssForCausalLM): pure composition of ops over a ForwardBatch.

Each layer: attention with biased q/k/v/o projections, YaRN rope, a learned sink logit per query
head in every softmax, and (on the sliding layers) a window of the last W positions; then a router
with a bias (top-k of its logits, softmax over the k: the router op's renormalised top-k) and the
routed experts through the MoE runtime, each adding its biases inside the clamped SwiGLU (the
runtime hands the op both: moe/runtime.py). No shared expert, no dense layers, no q/k norms.

Shape legend: T tokens in the step, H hidden, B sequences, V vocab, Hq query heads, G kv heads,
D head dim, k routed experts per token, E experts.
"""
from __future__ import annotations

import numpy as np

from freetoken.config import ModelConfig
from freetoken.models.forward_batch import ForwardBatch
from freetoken.models.rope_freqs import attention_factor, inv_freq


class GptOss:
    """Weights plus ops calls; stateless apart from the weights and the KV pool it is given."""

    def __init__(self, cfg: ModelConfig, weights, ops, moe, kv_pool, states=None):   # states: hybrids only
        self.cfg, self.w, self.ops, self.moe, self.kv = cfg, weights, ops, moe, kv_pool
        self.inv_freq = ops.to_device(inv_freq(cfg))
        self.moe_index = {layer: j for j, layer in enumerate(cfg.moe_layers)}
        # YaRN scales cos and sin, so q and k, by f: the scores by f squared
        self.scale = float(cfg.head_dim) ** -0.5 * attention_factor(cfg) ** 2

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Run every layer over the batch's new tokens; returns f32[B, V] logits."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        x = ops.embedding(batch.ids, self.w.embed)                       # [T, H]
        for layer, lw in enumerate(self.w.layers):
            x = x + self._attention(layer, lw, ops.rms_norm(x, lw.input_norm, eps), batch)
            x = x + self._experts(layer, lw, ops.rms_norm(x, lw.post_norm, eps), batch)
        last = ops.rms_norm(x[batch.last_index], self.w.final_norm, eps)  # [B, H]
        return ops.linear(last, self.w.lm_head)                          # [B, V]

    def _attention(self, layer: int, lw, h, batch: ForwardBatch):
        cfg, ops = self.cfg, self.ops
        T, D, Hq, G = h.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        qkv = ops.linear(h, lw.qkv) + lw.qkv_bias                       # [T, (Hq+2G)*D]
        q = ops.xp.ascontiguousarray(qkv[:, :Hq * D]).reshape(T, Hq, D)
        k = ops.xp.ascontiguousarray(qkv[:, Hq * D:(Hq + G) * D]).reshape(T, G, D)
        v = ops.xp.ascontiguousarray(qkv[:, (Hq + G) * D:]).reshape(T, G, D)
        q = ops.rope(q, batch.positions, self.inv_freq)
        k = ops.rope(k, batch.positions, self.inv_freq)
        k_cache, v_cache = self.kv.layer(layer)
        ops.kv_write(k, v, k_cache, v_cache, batch.slots)
        a = ops.attention(q, k_cache, v_cache, batch.slot_table, batch.tok_seq, batch.positions, self.scale,
                          sinks=lw.sinks, window=cfg.window(layer))     # [T, Hq, D]
        return ops.linear(a.reshape(T, Hq * D), lw.o_proj) + lw.o_bias  # [T, H]

    def _experts(self, layer: int, lw, h, batch: ForwardBatch):
        logits = self.ops.linear(h, lw.router) + lw.router_bias         # [T, E]
        ids, weights = self.ops.router(logits, self.cfg.num_experts_per_tok, True)   # [T, k] each
        return self.moe.forward(self.moe_index[layer], h, ids, weights, batch.prefill)
