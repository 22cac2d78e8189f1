"""bf16 <-> fp32 for numpy: bf16 travels as uint16 (numpy has no bfloat16)."""
import numpy as np


def to_f32(a: np.ndarray) -> np.ndarray:
    """Widen bf16 (uint16) to float32 by a 16-bit left shift; float arrays are cast to float32."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.asarray(a, dtype=np.float32)


def from_f32(a: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (round to nearest even, NaN kept NaN), returned as uint16."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = 0x7FC0
    return out
