"""An encoder for GGUF's Q4_K blocks, which gguf-py can read but not write (its ``quants.quantize``
covers Q8_0 and the 32-value formats only): `--quantize-experts q4_k` (models/requantize.py).

Q4_K (kernels/qblocks.py has the layout): a block of 256 values is eight sub-blocks of 32, each
value d*sc*q - dmin*m with q in 0..15, sc and m 6-bit per sub-block, d and dmin fp16 per block.
This encoder takes each sub-block's range as it is (min clamped to 0, so zero stays exact:
m*dmin >= 0), quantizes the eight ranges and minima against the block's largest (sc = range/d,
m = -min/dmin, d = largest range / 63), then every value to its nearest q against the scales as
stored (fp16 d and dmin, 6-bit sc and m). llama.cpp's quantizer also searches each sub-block's
scale and minimum for the least squared error; this one does not, so its error is somewhat larger
(the start-up log reports it).

Shape legend: N blocks, 8 sub-blocks of 32 values.
"""
import numpy as np

VALUES, NBYTES = 256, 144


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """f32[..., K] (K a multiple of 256) -> u8[..., K/256, 144] in Q4_K."""
    lead, K = w.shape[:-1], w.shape[-1]
    x = np.asarray(w, np.float32).reshape(-1, 8, 32)                        # [N, 8, 32]
    lo = np.minimum(x.min(axis=-1), 0.0)
    span, neg = (x.max(axis=-1) - lo) / np.float32(15.0), -lo                # [N, 8] each >= 0
    d = (span.max(axis=-1) / np.float32(63.0)).astype(np.float16)            # [N]
    dmin = (neg.max(axis=-1) / np.float32(63.0)).astype(np.float16)
    sc = _six_bits(span, d)
    mn = _six_bits(neg, dmin)
    a = d.astype(np.float32)[:, None] * sc                                   # the stored scales
    c = dmin.astype(np.float32)[:, None] * mn
    safe = np.where(a > 0, a, np.float32(1.0))[..., None]
    q = np.where(a[..., None] > 0, np.rint((x + c[..., None]) / safe), 0).clip(0, 15).astype(np.uint8)
    out = np.empty((x.shape[0], NBYTES), np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
    out[:, 4:16] = _pack_scales(sc.astype(np.uint8), mn.astype(np.uint8))
    out[:, 16:] = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)         # sub-blocks 2p, 2p+1
    return out.reshape(*lead, K // VALUES, NBYTES)


def _six_bits(v: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """round(v / unit) in 0..63 (0 where unit is 0), as f32."""
    u = unit.astype(np.float32)[:, None]
    return np.where(u > 0, np.rint(v / np.where(u > 0, u, 1)), 0).clip(0, 63).astype(np.float32)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit (scale, min) pairs into Q4_K's 12 bytes: bytes 0-3 hold scales 0-3 and the top
    2 bits of scales 4-7, bytes 4-7 mins 0-3 and the top 2 bits of mins 4-7, bytes 8-11 the low
    4 bits of scales 4-7 and of mins 4-7 (the inverse of qblocks._scale_min_k)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out
