"""The quantized weight formats: GGUF's block formats and FreeToken's row-block form of Qwen's
block FP8, the table the kernels switch on, and each format's spec (``dequantize_ref``): gguf-py's
``dequantize`` for the GGUF ones, the FP8 rule of kernels/qfp8.py.

A quantized weight is u8[..., R, NB, S]: R rows of NB blocks of S bytes; S names the format (each
has its own block size), a block holds V values, a row K = NB*V. A layout of a format's rows made
at load for the CPU (``LAYOUTS``: kernels/qlayout.py) is u8[..., R/G, NB, S]: groups of G rows,
each entry the G rows' blocks of one column interleaved.
"""
from dataclasses import dataclass

import numpy as np

from freetoken.kernels.qlayout import deinterleave, interleave_ref


@dataclass(frozen=True)
class QuantFormat:
    name: str      # "q8_0", "q4_k", ...
    ggml: int      # gguf.GGMLQuantizationType value
    values: int    # values per block
    nbytes: int    # bytes per block
    code: int      # the switch value of the numba kernels (the index in FORMATS, then LAYOUTS)
    rows: int = 1  # rows per entry: a LAYOUTS entry holds one block of each of `rows` rows

    @property
    def int8_dots(self) -> bool:
        """Whether the CPU kernels have int8 row dots for it (kernels/qact.py, qact.idot_row):
        every GGUF block format (not FreeToken's FP8 row blocks) and every interleaved layout (it
        exists for them)."""
        return self.ggml >= 0 or self.rows > 1


FORMATS = tuple(QuantFormat(name, ggml, values, nbytes, code) for code, (name, ggml, values, nbytes)
                in enumerate((("q4_0", 2, 32, 18), ("q4_1", 3, 32, 20), ("q5_0", 6, 32, 22),
                              ("q5_1", 7, 32, 24), ("q8_0", 8, 32, 34), ("q2_k", 10, 256, 84),
                              ("q3_k", 11, 256, 110), ("q4_k", 12, 256, 144),
                              ("q5_k", 13, 256, 176), ("q6_k", 14, 256, 210),
                              ("fp8_b128", -1, 128, 132),     # kernels/qfp8.py; not a GGML type
                              ("mxfp4", 39, 32, 17))))        # kernels/qmxfp4.py (gpt-oss's experts)
# CPU layouts made at load, never in a file nor on a GPU (kernels/qinterleave.py): q4_0's rows 16
# at a time, so a decode GEMV's int8 dot gives 16 rows a step
LAYOUTS = (QuantFormat("q4_0x16", -2, 32, 288, len(FORMATS), rows=16),)
_BY_BYTES = {f.nbytes: f for f in FORMATS + LAYOUTS}


def format_of_block_bytes(nbytes):
    """The format whose blocks are ``nbytes`` long; ValueError naming the size if none is."""
    if int(nbytes) not in _BY_BYTES:
        raise ValueError(f"no supported quantized format has {nbytes}-byte blocks "
                         f"(known: {sorted(_BY_BYTES)})")
    return _BY_BYTES[int(nbytes)]


def format_of_ggml(t):
    """The format of a gguf.GGMLQuantizationType (or its int value)."""
    for f in FORMATS:
        if f.ggml == int(t) and f.ggml >= 0:
            return f
    raise ValueError(f"GGML type {t!r} is not a supported quantized format")


def format_named(name):
    """The format called ``name`` ("q4_k", "Q4_K", ...)."""
    for f in FORMATS + LAYOUTS:
        if f.name == str(name).lower():
            return f
    raise ValueError(f"unknown quantized format {name!r} (known: {[f.name for f in FORMATS + LAYOUTS]})")


def is_quantized(w):
    """Is ``w`` a quantized weight u8[..., NB, S] with S a known block size? (Any array with
    numpy's dtype and shape: numpy or CuPy.)"""
    return (getattr(w, "dtype", None) == np.uint8 and getattr(w, "ndim", 0) >= 2
            and w.shape[-1] in _BY_BYTES)


def format_of(w):
    """The format of the quantized weight ``w`` (ValueError when it is not one)."""
    if not (getattr(w, "dtype", None) == np.uint8 and getattr(w, "ndim", 0) >= 2):
        raise ValueError(f"not a quantized weight: {getattr(w, 'dtype', type(w))} "
                         f"{getattr(w, 'shape', '')} (want uint8 [..., blocks, block bytes])")
    return format_of_block_bytes(w.shape[-1])


def logical_shape(w):
    """The shape of the values ``w`` holds: (..., NB*V) for a quantized weight u8[..., NB, S],
    (..., R, NB*V) for a layout's u8[..., R/G, NB, S], else ``w.shape``."""
    if is_quantized(w):
        f = format_of(w)
        rows = () if f.rows == 1 else (w.shape[-3] * f.rows,)
        return (*w.shape[:-3 if rows else -2], *rows, w.shape[-2] * f.values)
    return tuple(w.shape)


def dequantize_ref(w):
    """u8[..., NB, S] -> f32[..., NB*V] through gguf-py's ``dequantize`` (the spec)."""
    fmt = format_of(w)
    if fmt.rows > 1:
        return dequantize_ref(deinterleave(w))
    if fmt.ggml < 0:
        from freetoken.kernels.qfp8 import dequantize_fp8
        return dequantize_fp8(w)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    data = np.ascontiguousarray(w).reshape(*w.shape[:-2], w.shape[-2] * w.shape[-1])
    out = dequantize(data, GGMLQuantizationType(fmt.ggml))
    return np.asarray(out, np.float32).reshape(*w.shape[:-2], w.shape[-2] * fmt.values)


# where each GGUF format keeps its fp16 scale(s) in a block (FP8 row blocks: an f32 at 0)
F16_SCALES_AT = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
                 "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def random_blocks(name: str, rows: tuple, values: int, rng) -> np.ndarray:
    """u8[*rows, values/V, B] of format ``name``: random codes, small finite scales (random bytes
    there could be inf or NaN), no e4m3 NaN codes. For tests and for `bench bw --format`, whose
    speed must not depend on the weights."""
    f = format_named(name)
    if f.rows > 1:                  # the format's rows, interleaved (rows[-1] a multiple of f.rows)
        return interleave_ref(random_blocks("q4_0", rows, values, rng))
    if values % f.values:
        raise ValueError(f"{name}: rows of {values} values are not whole blocks of {f.values}")
    w = rng.integers(0, 256, tuple(rows) + (values // f.values, f.nbytes), dtype=np.uint8)
    if name == "mxfp4":         # exponents 2**-12 .. 2**-5: values up to 6 * 2**-5
        w[..., 0] = rng.integers(115, 123, w.shape[:-1], dtype=np.uint8)
        return w
    if name == "fp8_b128":
        w[..., 4:] &= 0xFE
        w[..., :4] = (rng.random(w.shape[:-1]) * 0.02 + 0.001).astype(np.float32)[..., None].view(np.uint8)
        return w
    for at in F16_SCALES_AT[name]:
        scale = (rng.random(w.shape[:-1]) * 0.02 + 0.001).astype(np.float16)
        w[..., at:at + 2] = scale[..., None].view(np.uint8)
    return w
