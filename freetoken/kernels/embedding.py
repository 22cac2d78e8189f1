"""Token embedding gather, widened to fp32; pairs: cuda/embedding.cu,
tests/kernels/test_embedding.py."""
import numpy as np

from freetoken.kernels._bf16 import to_f32
from freetoken.kernels.qformats import dequantize_ref, is_quantized, logical_shape


def ref(ids, table, out=None):
    """ids int32[T], table [V,H] (bf16 bits or float; quantized [V,H/V',B], kernels/qblocks.py)
    -> f32[T,H]."""
    rows = table[np.asarray(ids)]
    res = dequantize_ref(rows) if is_quantized(table) else to_f32(rows)
    if out is None:
        return res
    out[...] = res
    return out


def cpu(ids, table, out=None):
    """Same contract as ``ref``; numpy is already fast here (one gather, one widening pass)."""
    ids = np.asarray(ids)
    if out is None:
        out = np.empty((ids.shape[0], logical_shape(table)[1]), np.float32)
    if is_quantized(table):
        from freetoken.kernels.linear_quant import dequant_rows
        dequant_rows(table[ids], out)
    elif table.dtype == np.uint16:
        # widen straight into out: the shift writes the fp32 bit patterns in place
        np.left_shift(table[ids], 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        out[...] = table[ids]
    return out


# --- gpu: cuda/embedding.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "embedding_bf16": ("ids:i32*", "table:u16*", "out:f32*", "T:i32", "H:i32", "V:i32"),
    "embedding_f32": ("ids:i32*", "table:f32*", "out:f32*", "T:i32", "H:i32", "V:i32"),
    "q_rows_f32": ("w:u8*", "ids:i32*", "out:f32*", "R:i32", "K:i32", "V:i32"),   # cuda/qblocks.cu
}


def gpu(ids, table, out):
    """Same contract as ``ref`` on CuPy arrays; ``out`` f32[T,H] is required (CUDA graphs need
    fixed addresses). An id outside [0, V) yields a NaN row: a kernel cannot raise."""
    from freetoken.kernels import _cuda
    (T,), (V, H) = ids.shape, logical_shape(table)
    assert out.shape == (T, H), (out.shape, (T, H))
    if is_quantized(table):    # one module per format (cuda/qblocks.cu): the rows dequantized
        args = _cuda.bind(ARGS["q_rows_f32"], w=table, ids=ids, out=out, R=T, K=H, V=V)
        kern = _cuda.kernel("qblocks", "q_rows_f32", _cuda.quant_defines(table))
        _cuda.launch(kern, (T, -(-H // 1024)), (128,), args)
        return out
    entry = f"embedding_{_cuda.dtype_tag(table)}"
    args = _cuda.bind(ARGS[entry], ids=ids, table=table, out=out, T=T, H=H, V=V)
    _cuda.launch(_cuda.kernel("embedding", entry), (T,), (_cuda.threads(H // 4, 256),), args)
    return out
