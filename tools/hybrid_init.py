"""Start the hybrid demo model from the Qwen3-MoE one (dev time only; used by train_demo.py).

A Qwen3.5-MoE-layout model trained from nothing on two cores spends most of its hour relearning
what tiny-agent-moe already knows: the embedding, the output head, the routed experts and the
router. Those have the same shapes in both layouts, so they are copied; what the hybrid adds
starts so that it changes nothing at first and is learned:
  - Gated DeltaNet layers (layers 0-2 here, attention there): random, out_proj zero, so each
    starts as an identity residual and grows in;
  - the full-attention layer: q/k/v/o copied per head, its output gate weights zero (sigmoid 0.5,
    o_proj doubled to compensate), rotary on a quarter of head_dim instead of all of it (the
    copied heads relearn their positions);
  - the shared expert: random with down_proj zero;
  - norms: Qwen3.5 stores RMSNorm weights as w - 1 (it scales by 1 + w).
"""
from __future__ import annotations


def transplant(hybrid, donor, torch) -> list[str]:
    """Copy donor (Qwen3MoeForCausalLM) weights into hybrid (Qwen3_5MoeForCausalLM) in place;
    returns the names of the hybrid parameters that were copied."""
    src = dict(donor.named_parameters())
    dst = dict(hybrid.named_parameters())
    copied = []

    def put(name: str, value) -> None:
        with torch.no_grad():
            dst[name].copy_(value)
        copied.append(name)

    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        put(name, src[name])
    put("model.norm.weight", src["model.norm.weight"] - 1)
    cfg = hybrid.config
    for i, kind in enumerate(cfg.layer_types):
        pre = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            put(pre + norm + ".weight", src[pre + norm + ".weight"] - 1)
        for w in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
            put(pre + "mlp." + w, src[pre + "mlp." + w])
        with torch.no_grad():
            dst[pre + "mlp.shared_expert.down_proj.weight"].zero_()
        if kind == "full_attention":
            _attention(put, src, dst, pre, cfg, torch)
        else:
            with torch.no_grad():
                dst[pre + "linear_attn.out_proj.weight"].zero_()
    return copied


def _attention(put, src, dst, pre: str, cfg, torch) -> None:
    """q_proj there holds, per head, [query (head_dim); gate (head_dim)] rows."""
    a = pre + "self_attn."
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    q = src[a + "q_proj.weight"].reshape(heads, hd, -1)
    put(a + "q_proj.weight", torch.cat([q, torch.zeros_like(q)], dim=1).reshape(heads * 2 * hd, -1))
    for w in ("k_proj.weight", "v_proj.weight"):
        put(a + w, src[a + w])
    put(a + "o_proj.weight", 2 * src[a + "o_proj.weight"])
    for w in ("q_norm.weight", "k_norm.weight"):
        put(a + w, src[a + w] - 1)
