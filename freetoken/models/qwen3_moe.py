"""Qwen3-MoE forward pass (Qwen3MoeForCausalLM): pure composition of ops over a ForwardBatch.

Shape legend: T tokens in the step, H hidden, B sequences, V vocab, Hq query heads, G kv heads,
D head dim, k routed experts per token, N KV token slots.
"""
from __future__ import annotations

import numpy as np

from freetoken.config import ModelConfig
from freetoken.models.forward_batch import ForwardBatch
from freetoken.models.rope_freqs import attention_factor, inv_freq


class Qwen3Moe:
    """Weights plus ops calls; stateless apart from the weights and the KV pool it is given."""

    def __init__(self, cfg: ModelConfig, weights, ops, moe, kv_pool, states=None):   # states: hybrids only
        self.cfg, self.w, self.ops, self.moe, self.kv = cfg, weights, ops, moe, kv_pool
        self.inv_freq = ops.to_device(inv_freq(cfg))
        self.moe_index = {layer: j for j, layer in enumerate(cfg.moe_layers)}
        self.scale = float(cfg.head_dim) ** -0.5 * attention_factor(cfg) ** 2    # YaRN's factor on q and k

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Run every layer over the batch's new tokens; returns f32[B, V] logits."""
        ops = self.ops
        x = ops.embedding(batch.ids, self.w.embed)                       # [T, H]
        if not self._decode_stack(x, batch):
            for layer, lw in enumerate(self.w.layers):
                x, h, routing, experts_added = self._attention_half(layer, lw, x, batch)
                if not experts_added:
                    x = x + self._mlp(layer, lw, h, batch, routing)
        last = ops.rms_norm(x[batch.last_index], self.w.final_norm, self.cfg.rms_norm_eps)  # [B, H]
        return ops.linear(last, self.w.lm_head)                          # [B, V]

    def _decode_stack(self, x, batch: ForwardBatch) -> bool:
        """Whether every layer ran on x in place in one call (ops.decode_stack, where the backend
        has one and takes the step: one token, every layer's routed experts on the CPU), the MoE
        runtime's counters told each layer's route as routed_inline tells them."""
        ops, cfg = self.ops, self.cfg
        if ops.decode_stack is None or batch.prefill or x.shape[0] != 1:
            return False
        banks = [None if lw.router is None else self.moe.inline_bank(self.moe_index[layer], False)
                 for layer, lw in enumerate(self.w.layers)]
        ids = ops.decode_stack(x, self.w.layers, self.kv, banks, batch, self.inv_freq, cfg.rms_norm_eps, self.scale,
                               (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                               (cfg.num_experts_per_tok, cfg.norm_topk_prob))
        if ids is None:
            return False
        for layer, j in self.moe_index.items():              # every layer is a MoE layer here
            self.moe.routed_inline(j, ids[layer])
        return True

    def _attention_half(self, layer: int, lw, x, batch: ForwardBatch):
        """(x + attention, its post-attention norm h, the router's (ids, weights) of h or None,
        whether the routed experts were added into x too): ops.decode_layer's one call where the
        backend has one and takes the step (x updated in place; the experts with it when the MoE
        runtime hands over the layer's host bank), else composed from the ops."""
        ops, cfg = self.ops, self.cfg
        if ops.decode_layer is not None:
            k_cache, v_cache = self.kv.layer(layer)
            j = self.moe_index.get(layer) if lw.router is not None else None
            bank = None if j is None else self.moe.inline_bank(j, batch.prefill)
            fused = ops.decode_layer(x, lw, k_cache, v_cache, batch, self.inv_freq, cfg.rms_norm_eps, self.scale,
                                     (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                                     (cfg.num_experts_per_tok, cfg.norm_topk_prob), bank)
            if fused is not None:
                if fused[2]:
                    self.moe.routed_inline(j, fused[1][0])
                return x, *fused
        x = x + self._attention(layer, lw, ops.rms_norm(x, lw.input_norm, cfg.rms_norm_eps), batch)
        return x, ops.rms_norm(x, lw.post_norm, cfg.rms_norm_eps), None, False

    def _attention(self, layer: int, lw, h, batch: ForwardBatch):
        cfg, ops = self.cfg, self.ops
        T, D, Hq, G = h.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        qkv = ops.linear(h, lw.qkv)                                      # [T, (Hq+2G)*D]
        q = self._head_norm(qkv[:, :Hq * D], lw.q_norm, T, Hq)           # [T, Hq, D]
        k = self._head_norm(qkv[:, Hq * D:(Hq + G) * D], lw.k_norm, T, G)
        v = ops.xp.ascontiguousarray(qkv[:, (Hq + G) * D:]).reshape(T, G, D)
        q = ops.rope(q, batch.positions, self.inv_freq)
        k = ops.rope(k, batch.positions, self.inv_freq)
        k_cache, v_cache = self.kv.layer(layer)
        ops.kv_write(k, v, k_cache, v_cache, batch.slots)
        a = ops.attention(q, k_cache, v_cache, batch.slot_table, batch.tok_seq, batch.positions,
                          self.scale)                                    # [T, Hq, D]
        return ops.linear(a.reshape(T, Hq * D), lw.o_proj)               # [T, H]

    def _head_norm(self, x, w, T: int, heads: int):
        """Per-head RMSNorm over D (Qwen3 q_norm/k_norm), applied before RoPE."""
        D = self.cfg.head_dim
        x = self.ops.xp.ascontiguousarray(x).reshape(T * heads, D)
        return self.ops.rms_norm(x, w, self.cfg.rms_norm_eps).reshape(T, heads, D)

    def _mlp(self, layer: int, lw, h, batch: ForwardBatch, routing=None):
        """routing: the router's (ids, weights) of h when computed already (ops.decode_layer)."""
        ops, cfg = self.ops, self.cfg
        if lw.router is None:   # dense SwiGLU layer: one "expert" with weight 1
            T = h.shape[0]
            ids = ops.xp.zeros((T, 1), dtype=np.int32)
            weights = ops.xp.ones((T, 1), dtype=np.float32)
            return ops.experts(h, ids, weights, lw.gate_up, lw.down)
        ids, weights = routing or ops.router(ops.linear(h, lw.router), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        return self.moe.forward(self.moe_index[layer], h, ids, weights, batch.prefill)
