"""gpt-oss forward pass (GptOssForCausalLM): pure composition of ops over a ForwardBatch.

Each layer: attention with biased q/k/v/o projections, YaRN rope, a learned sink logit per query
head in every softmax, and (on the sliding layers) a window of the last W positions; then a router
with a bias (top-k of its logits, softmax over the k: the router op's renormalised top-k) and the
routed experts through the MoE runtime, each adding its biases inside the clamped SwiGLU (the
runtime hands the op both: moe/runtime.py). No shared expert, no dense layers, no q/k norms.

The full layers' KV is in the token pool; the sliding layers' is per-request state, a ring per
request row (engine/window_pool.py): their KV write and attention run in pieces of the pool's
piece size, and a state cut of the step (engine/resume.py's checkpoints) is handed the rings of
its row right after the piece that reaches it.

Shape legend: T tokens in the step, H hidden, B sequences, V vocab, Hq query heads, G kv heads,
D head dim, k routed experts per token, E experts.
"""
from __future__ import annotations

import numpy as np

from freetoken.config import ModelConfig
from freetoken.models.forward_batch import ForwardBatch
from freetoken.models.rope_freqs import attention_factor, inv_freq


class GptOss:
    """Weights plus ops calls; stateless apart from the weights, the KV pool and the window pool."""

    def __init__(self, cfg: ModelConfig, weights, ops, moe, kv_pool, states=None):   # states: WindowPool
        self.cfg, self.w, self.ops, self.moe, self.kv, self.windows = cfg, weights, ops, moe, kv_pool, states
        assert (states is not None) == cfg.sliding_kv, "a sliding-window model runs over a window pool"
        self.kv_index = {layer: j for j, layer in enumerate(cfg.attention_layers)}
        self.window_index = {layer: j for j, layer in enumerate(cfg.sliding_layers)}
        self.inv_freq = ops.to_device(inv_freq(cfg))
        self.moe_index = {layer: j for j, layer in enumerate(cfg.moe_layers)}
        # YaRN scales cos and sin, so q and k, by f: the scores by f squared
        self.scale = float(cfg.head_dim) ** -0.5 * attention_factor(cfg) ** 2

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Run every layer over the batch's new tokens; returns f32[B, V] logits."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        rings = self._rings(batch) if self.windows is not None else None
        x = ops.embedding(batch.ids, self.w.embed)                       # [T, H]
        for layer, lw in enumerate(self.w.layers):
            x = x + self._attention(layer, lw, ops.rms_norm(x, lw.input_norm, eps), batch, rings)
            x = x + self._experts(layer, lw, ops.rms_norm(x, lw.post_norm, eps), batch)
        last = ops.rms_norm(x[batch.last_index], self.w.final_norm, eps)  # [B, H]
        return ops.linear(last, self.w.lm_head)                          # [B, V]

    def _rings(self, batch: ForwardBatch):
        """(ring slot int32[T] of each token, slot table int32[B, C], cuts (t, row, sink)) of the
        sliding layers in this step (device arrays: in a captured decode step too)."""
        xp, pool = self.ops.xp, self.windows
        rows = xp.asarray(batch.state_slots)
        slots = pool.slots(rows, xp.asarray(batch.tok_seq), xp.asarray(batch.positions))
        cuts = [(piece.hi, row, sink) for piece in batch.state_cuts for row, sink in piece.sinks]
        return slots, pool.table(rows, batch.slot_table.shape[1]), cuts

    def _attention(self, layer: int, lw, h, batch: ForwardBatch, rings):
        cfg, ops = self.cfg, self.ops
        T, D, Hq, G = h.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        qkv = ops.linear(h, lw.qkv) + lw.qkv_bias                       # [T, (Hq+2G)*D]
        q = ops.xp.ascontiguousarray(qkv[:, :Hq * D]).reshape(T, Hq, D)
        k = ops.xp.ascontiguousarray(qkv[:, Hq * D:(Hq + G) * D]).reshape(T, G, D)
        v = ops.xp.ascontiguousarray(qkv[:, (Hq + G) * D:]).reshape(T, G, D)
        q = ops.rope(q, batch.positions, self.inv_freq)
        k = ops.rope(k, batch.positions, self.inv_freq)
        if layer in self.window_index:
            a = self._sliding(self.window_index[layer], q, k, v, batch, rings, lw.sinks)
        else:
            k_cache, v_cache = self.kv.layer(self.kv_index[layer])
            ops.kv_write(k, v, k_cache, v_cache, batch.slots)
            a = ops.attention(q, k_cache, v_cache, batch.slot_table, batch.tok_seq, batch.positions, self.scale,
                              sinks=lw.sinks)                            # [T, Hq, D]
        return ops.linear(a.reshape(T, Hq * D), lw.o_proj) + lw.o_bias  # [T, H]

    def _sliding(self, j: int, q, k, v, batch: ForwardBatch, rings, sinks):
        """Sliding layer j's attention over its rings, in pieces of at most the pool's piece size
        (a piece's keys written before its queries read; the ring keeps W + piece positions a row);
        after each piece, the cuts it reaches get their rows' rings."""
        ops, pool = self.ops, self.windows
        slots, table, cuts = rings
        k_ring, v_ring = pool.layer(j)
        T, R, outs = q.shape[0], pool.ring, []
        for lo in range(0, T, pool.piece):
            hi = min(lo + pool.piece, T)
            ops.kv_write(k[lo:hi], v[lo:hi], k_ring, v_ring, slots[lo:hi])
            outs.append(ops.attention(q[lo:hi], k_ring, v_ring, table, batch.tok_seq[lo:hi], batch.positions[lo:hi],
                                      self.scale, sinks=sinks, window=pool.window))   # [hi-lo, Hq, D]
            for t, row, sink in cuts:
                if lo < t <= hi:
                    sink("k", j, k_ring[row * R:(row + 1) * R])
                    sink("v", j, v_ring[row * R:(row + 1) * R])
        return outs[0] if len(outs) == 1 else ops.xp.concatenate(outs)

    def _experts(self, layer: int, lw, h, batch: ForwardBatch):
        logits = self.ops.linear(h, lw.router) + lw.router_bias         # [T, E]
        ids, weights = self.ops.router(logits, self.cfg.num_experts_per_tok, True)   # [T, k] each
        return self.moe.forward(self.moe_index[layer], h, ids, weights, batch.prefill)
