"""Token embedding gather, widened to fp32; pairs: cuda/embedding.cu, tests/kernels/test_embedding.py."""
import numpy as np

from freetoken.kernels._bf16 import to_f32


def ref(ids, table, out=None):
    """ids int32[T], table [V,H] (bf16 bits or float) -> f32[T,H]."""
    res = to_f32(table[np.asarray(ids)])
    if out is None:
        return res
    out[...] = res
    return out


def cpu(ids, table, out=None):
    """Same contract as ``ref``; numpy is already fast here (one gather, one widening pass)."""
    ids = np.asarray(ids)
    if out is None:
        out = np.empty((ids.shape[0], table.shape[1]), np.float32)
    if table.dtype == np.uint16:
        # widen straight into out: the shift writes the fp32 bit patterns in place
        np.left_shift(table[ids], 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        out[...] = table[ids]
    return out
