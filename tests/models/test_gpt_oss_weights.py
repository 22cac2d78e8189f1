"""The gpt-oss loader's two expert layouts against an independent reading of the stored tensors:
dense [E, H, 2I] with gate and up columns interleaved, and the hub's MXFP4 blocks (value 2i in
the low nibble of byte i) with their e8m0 exponents."""
from pathlib import Path

import numpy as np

from freetoken.kernels.qformats import dequantize_ref, format_of
from freetoken.models.hf_config import read_model_config
from freetoken.models.safetensors_io import Checkpoint
from freetoken.models.weights import load_weights

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "gpt_oss"
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _hub_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """f32[..., C] of blocks u8[..., C/32, 16] and scales u8[..., C/32], as the hub's format says."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = E2M1[codes] * np.exp2(scales.astype(np.float32) - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def test_dense_experts_read_gate_rows_first_from_interleaved_columns():
    d = FIXTURE / "fp32"
    cfg = read_model_config(d)
    w = load_weights(d, cfg).layers[1]
    ck, p = Checkpoint(d), "model.layers.1.mlp.experts."
    stored = ck.get(p + "gate_up_proj", (8, 64, 64))                 # [E, H, 2I]
    np.testing.assert_array_equal(w.gate_up[:, :32], stored[:, :, 0::2].transpose(0, 2, 1))
    np.testing.assert_array_equal(w.gate_up[:, 32:], stored[:, :, 1::2].transpose(0, 2, 1))
    np.testing.assert_array_equal(w.down, ck.get(p + "down_proj", (8, 32, 64)).transpose(0, 2, 1))
    bias = ck.get(p + "gate_up_proj_bias", (8, 64))
    np.testing.assert_array_equal(w.gate_up_bias, np.concatenate([bias[:, 0::2], bias[:, 1::2]], 1))


def test_mxfp4_experts_keep_the_stored_values_exactly_in_their_blocks():
    d = FIXTURE / "mxfp4"
    cfg = read_model_config(d)
    w = load_weights(d, cfg).layers[2]
    ck, p = Checkpoint(d), "model.layers.2.mlp.experts."
    assert format_of(w.gate_up).name == "mxfp4" and format_of(w.down).name == "mxfp4"
    gate_up = _hub_mxfp4(ck.get(p + "gate_up_proj_blocks", (8, 64, 2, 16)), ck.get(p + "gate_up_proj_scales", (8, 64, 2)))
    down = _hub_mxfp4(ck.get(p + "down_proj_blocks", (8, 64, 1, 16)), ck.get(p + "down_proj_scales", (8, 64, 1)))
    for e in range(8):
        np.testing.assert_array_equal(dequantize_ref(w.gate_up[e]), np.concatenate([gate_up[e, 0::2], gate_up[e, 1::2]]))
        np.testing.assert_array_equal(dequantize_ref(w.down[e]), down[e])
    assert w.qkv.dtype == np.float32 and w.sinks.dtype == np.float32


def test_the_hub_repack_is_exact_for_every_byte_and_exponent_and_keeps_the_row_order():
    """kernels/qmxfp4.from_hub_blocks on every code pair in every byte and exponents 0..200 (e < 2:
    subnormal scales; far above, float32 exp2 itself rounds), rows
    reordered as the loader reorders gate_up's (gate rows first)."""
    from freetoken.kernels.qmxfp4 import from_hub_blocks
    rng = np.random.default_rng(0)
    R, NB = 64, 5
    blocks = rng.permutation(np.tile(np.arange(256, dtype=np.uint8), R * NB * 16 // 256)).reshape(R, NB, 16)
    scales = (np.arange(R * NB) % 201).astype(np.uint8).reshape(R, NB)
    order = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])
    packed = from_hub_blocks(blocks, scales, order)
    assert packed.shape == (R, NB, 17) and format_of(packed).name == "mxfp4"
    np.testing.assert_array_equal(dequantize_ref(packed), _hub_mxfp4(blocks, scales)[order])
