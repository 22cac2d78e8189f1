"""The Q4_K encoder (kernels/qencode.py) through the spec's decoder (gguf-py's dequantize): the
values come back within Q4_K's error, zero rows and sub-blocks exactly, every sub-block's scale
and minimum (the 6-bit packing of sub-blocks 4-7 included) where the decoder reads them."""
import numpy as np

from freetoken.kernels.qencode import encode_q4_k
from freetoken.kernels.qformats import dequantize_ref, format_of


def test_round_trip_error_is_q4_ks():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 1024)) * 0.02).astype(np.float32)
    q = encode_q4_k(w)
    assert q.shape == (48, 4, 144) and format_of(q).name == "q4_k"
    err = np.sqrt(np.mean((dequantize_ref(q) - w) ** 2) / np.mean(w ** 2))
    assert 0.02 < err < 0.1, err


def test_each_sub_block_keeps_its_own_range():
    """Sub-block j holds values around 10*j (a wrong scale or minimum for any j, as a misplaced
    6-bit field would give, is far off); a zero sub-block decodes to exact zeros."""
    rng = np.random.default_rng(1)
    w = (rng.random((3, 256)) + np.repeat(np.arange(8) * 10.0, 32)).astype(np.float32)
    w[1] = -w[1]
    w[2, 64:96] = 0.0
    back = dequantize_ref(encode_q4_k(w))
    assert np.abs(back - w).max() < 0.05 * np.abs(w).max()
    assert np.all(back[2, 64:96] == 0.0)
    zero = dequantize_ref(encode_q4_k(np.zeros((2, 512), np.float32)))
    assert np.all(zero == 0.0)
