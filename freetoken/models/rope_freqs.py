"""RoPE inverse frequencies of every family, from ModelConfig's rope_theta and rope_scaling:
default, linear (positions divided by a factor), and YaRN (gpt-oss: each frequency blended
between its interpolated and its original value by a linear ramp over the dimensions, and an
attention factor that scales cos and sin).

The rope op takes only inverse frequencies, so YaRN's attention factor f, which multiplies both q
and k, reaches the model as `attention_factor`: the softmax scale times f squared (the same scores).

Shape legend: R rotary dims of a head (head_dim times the partial rotary factor).
"""
from __future__ import annotations

import math

import numpy as np

from freetoken.config import ModelConfig


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """f32[R/2] NeoX inverse frequencies over the R leading dims of each head."""
    R = cfg.rotary_dim
    base = 1.0 / (cfg.rope_theta ** (np.arange(0, R, 2, dtype=np.float64) / R))
    kind = (cfg.rope_scaling or {}).get("rope_type")
    if kind == "linear":
        base = base / cfg.rope_scaling["factor"]
    elif kind == "yarn":
        base = _yarn(base, cfg.rope_scaling, R, cfg.rope_theta)
    return base.astype(np.float32)


def attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1.0 for the other kinds): the configured one, else
    0.1 ln(factor) + 1, or the ratio of the two mscale terms when mscale and mscale_all_dim are set."""
    s = cfg.rope_scaling or {}
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = s["factor"]
    if s.get("mscale") and s.get("mscale_all_dim"):
        return _mscale(factor, s["mscale"]) / _mscale(factor, s["mscale_all_dim"])
    return _mscale(factor, 1.0)


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn(original: np.ndarray, s: dict, R: int, theta: float) -> np.ndarray:
    """Dims that turn fewer than beta_slow times over the original context are interpolated
    (divided by the factor), those turning more than beta_fast times kept, a linear ramp between."""
    def turning_dim(rotations: float) -> float:
        return R * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turning_dim(s.get("beta_fast") or 32), turning_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001                                   # no division by zero in the ramp
    ramp = np.clip((np.arange(R // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float64)                # 1: the original frequency
    return (original / s["factor"]) * (1 - keep) + original * keep
