"""Gated DeltaNet hybrid forward pass (Qwen3-Next, Qwen3.5/3.6-MoE): pure composition of ops.

Layers alternate Gated DeltaNet (linear attention with a recurrent state per sequence, kept in
the engine's StatePool) and gated full attention (KV in the KV pool, which holds only these
layers); every layer ends in an MLP: routed experts through the MoE runtime plus a dense shared
expert scaled by a sigmoid gate, or a dense SwiGLU. Norm weights arrive as the factor to multiply
by (the loader folded the Gemma-style 1 + w in).

Shape legend: T tokens in the step, H hidden, B sequences, V vocab, Hq query heads, G kv heads,
D head dim, Hk / Hv GDN key / value heads, Dk / Dv their dims, C conv channels.
"""
from __future__ import annotations

import numpy as np

from freetoken.config import ModelConfig
from freetoken.models.forward_batch import ForwardBatch
from freetoken.models.rope_freqs import attention_factor, inv_freq


class Qwen3Next:
    def __init__(self, cfg: ModelConfig, weights, ops, moe, kv_pool, states=None):
        self.cfg, self.w, self.ops, self.moe, self.kv, self.states = cfg, weights, ops, moe, kv_pool, states
        self.inv_freq = ops.to_device(inv_freq(cfg))
        self.moe_index = {layer: j for j, layer in enumerate(cfg.moe_layers)}
        self.kv_index = {layer: j for j, layer in enumerate(cfg.attention_layers)}
        self.gdn_index = {layer: j for j, layer in enumerate(cfg.linear_layers)}
        self.scale = float(cfg.head_dim) ** -0.5 * attention_factor(cfg) ** 2    # YaRN's factor on q and k

    def forward(self, batch: ForwardBatch):
        """Every layer over the batch's new tokens; returns f32[R, V] logits of batch.last_index."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        pieces = [(p.lo, p.hi, ops.to_device(p.state_slots), ops.to_device(p.seq_starts), p.sinks)
                  for p in batch.state_cuts] or [(0, None, batch.state_slots, batch.seq_starts, ())]
        x = ops.embedding(batch.ids, self.w.embed)                       # [T, H]
        for layer, lw in enumerate(self.w.layers):
            h = ops.rms_norm(x, lw.input_norm, eps)
            x = x + (self._gdn(layer, lw, h, pieces) if lw.is_linear else self._attention(layer, lw, h, batch))
            x = x + self._mlp(layer, lw, ops.rms_norm(x, lw.post_norm, eps), batch)
        last = ops.rms_norm(x[batch.last_index], self.w.final_norm, eps)
        return ops.linear(last, self.w.lm_head)

    def _gdn(self, layer: int, lw, h, pieces):
        """pieces: (lo, hi, state rows, seq_starts, sinks) of the step's state cuts
        (models/state_cuts.py), or one piece of the whole step."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        T, Hk, Hv, Dk, Dv, C = h.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads, \
            cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.conv_dim
        j = self.gdn_index[layer]
        proj = ops.linear(h, lw.in_proj)                                 # [T, C + Hv*Dv + 2*Hv]
        conv_state, rule_state = self.states.layer(j)
        x = xp.ascontiguousarray(proj[:, :C])
        mixed = self._piecewise(pieces, "conv", j, conv_state, lambda lo, hi, rows, starts: ops.gdn_conv(
            x[lo:hi], lw.conv, conv_state, rows, starts))               # [T, C]
        part = lambda lo, n, shape: xp.ascontiguousarray(mixed[:, lo:lo + n]).reshape(shape)
        q = part(0, Hk * Dk, (T, Hk, Dk))
        k = part(Hk * Dk, Hk * Dk, (T, Hk, Dk))
        v = part(2 * Hk * Dk, Hv * Dv, (T, Hv, Dv))
        z = xp.ascontiguousarray(proj[:, C:C + Hv * Dv]).reshape(T * Hv, Dv)
        b = xp.ascontiguousarray(proj[:, C + Hv * Dv:C + Hv * Dv + Hv])
        a = xp.ascontiguousarray(proj[:, C + Hv * Dv + Hv:])
        o = self._piecewise(pieces, "rule", j, rule_state, lambda lo, hi, rows, starts: ops.gdn_rule(
            q[lo:hi], k[lo:hi], v[lo:hi], a[lo:hi], b[lo:hi], lw.A_log, lw.dt_bias, rule_state, rows,
            starts))                                                     # [T, Hv, Dv]
        o = ops.gated_rms_norm(o.reshape(T * Hv, Dv), z, lw.gdn_norm, cfg.rms_norm_eps)
        return ops.linear(o.reshape(T, Hv * Dv), lw.out_proj)            # [T, H]

    def _piecewise(self, pieces, kind: str, j: int, state, run):
        """run(lo, hi, state rows, seq_starts) over each piece in order, the state after a piece
        handed to the sinks of its cuts before the next piece moves it on; outputs concatenated."""
        outs = []
        for lo, hi, rows, starts, sinks in pieces:
            outs.append(run(lo, hi, rows, starts))
            for row, sink in sinks:
                sink(kind, j, state[row])
        return outs[0] if len(outs) == 1 else self.ops.xp.concatenate(outs)

    def _attention(self, layer: int, lw, h, batch: ForwardBatch):
        """Gated attention: q_proj gives each head's query and gate side by side."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        T, D, Hq, G = h.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        qkv = ops.linear(h, lw.qkv)                                      # [T, 2*Hq*D + 2*G*D]
        qg = qkv[:, :2 * Hq * D].reshape(T, Hq, 2 * D)
        q = self._head_norm(qg[:, :, :D], lw.q_norm, T, Hq)
        gate = xp.ascontiguousarray(qg[:, :, D:]).reshape(T, Hq * D)
        k = self._head_norm(qkv[:, 2 * Hq * D:(2 * Hq + G) * D], lw.k_norm, T, G)
        v = xp.ascontiguousarray(qkv[:, (2 * Hq + G) * D:]).reshape(T, G, D)
        q = ops.rope(q, batch.positions, self.inv_freq)
        k = ops.rope(k, batch.positions, self.inv_freq)
        k_cache, v_cache = self.kv.layer(self.kv_index[layer])
        ops.kv_write(k, v, k_cache, v_cache, batch.slots)
        att = ops.attention(q, k_cache, v_cache, batch.slot_table, batch.tok_seq, batch.positions, self.scale)
        return ops.linear(ops.sigmoid_mul(att.reshape(T, Hq * D), gate), lw.o_proj)

    def _head_norm(self, x, w, T: int, heads: int):
        D = self.cfg.head_dim
        x = self.ops.xp.ascontiguousarray(x).reshape(T * heads, D)
        return self.ops.rms_norm(x, w, self.cfg.rms_norm_eps).reshape(T, heads, D)

    def _mlp(self, layer: int, lw, h, batch: ForwardBatch):
        ops, cfg, xp = self.ops, self.cfg, self.ops.xp
        T = h.shape[0]
        one, ones = xp.zeros((T, 1), dtype=np.int32), xp.ones((T, 1), dtype=np.float32)
        if lw.router is None:                 # dense SwiGLU layer: one "expert" with weight 1
            return ops.experts(h, one, ones, lw.gate_up, lw.down)
        shared = None
        if lw.shared_gate_up is not None:     # before the routed experts, which may reuse h
            shared = ops.sigmoid_mul(ops.experts(h, one, ones, lw.shared_gate_up, lw.shared_down),
                                     ops.linear(h, lw.shared_gate))      # [T, H] x sigmoid([T, 1])
        ids, weights = ops.router(ops.linear(h, lw.router), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        routed = self.moe.forward(self.moe_index[layer], h, ids, weights, batch.prefill)
        return routed if shared is None else routed + shared
