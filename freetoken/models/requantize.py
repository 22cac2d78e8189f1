"""--quantize-experts: a dense checkpoint's routed experts quantized at load, for the user with a
bf16 download and too little memory for it: q8_0 (GGUF's Q8_0 blocks, by gguf-py's quantizer), q4_k
(GGUF's Q4_K blocks, kernels/qencode.py: gguf-py has no Q4_K quantizer) or fp8 (e4m3 codes in
FreeToken's row blocks of 128, kernels/qfp8.py). The dense banks are freed when
the quantized model replaces the loaded one, so start-up peaks at the dense model plus the blocks
(a streaming quantizer inside the loader would avoid that: not done). One log line says the bytes
before and after and the relative RMS error of the quantized weights against their dense values.

Shape legend: E experts, I expert width, H hidden.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from freetoken.kernels._bf16 import to_f32
from freetoken.kernels.qformats import dequantize_ref, is_quantized


def quantize_rows(w: np.ndarray, fmt: str) -> np.ndarray:
    """f32[R, K] -> u8[R, K/V, B] in format fmt ("q8_0", "q4_k" or "fp8")."""
    if fmt == "fp8":
        from freetoken.kernels.qfp8 import quantize_fp8_rows
        return quantize_fp8_rows(w)
    if fmt == "q4_k":
        from freetoken.kernels.qencode import encode_q4_k
        return encode_q4_k(w)
    from gguf import GGMLQuantizationType, quants
    q = quants.quantize(np.ascontiguousarray(w, np.float32), GGMLQuantizationType.Q8_0)
    return q.reshape(w.shape[0], w.shape[1] // 32, 34)


def quantize_experts(weights, moe_layers, fmt: str, log):
    """weights with every MoE layer's gate_up and down quantized to fmt; unchanged for "none" or
    when the experts are quantized already (said in the log)."""
    if fmt == "none" or not moe_layers:
        return weights
    if is_quantized(weights.layers[moe_layers[0]].gate_up):
        log.info("--quantize-experts %s: the checkpoint's experts are quantized already; left as they are", fmt)
        return weights
    layers, before, after, err, total = list(weights.layers), 0, 0, 0.0, 0.0
    for i in moe_layers:
        banks = []
        for bank in (layers[i].gate_up, layers[i].down):
            out = np.empty(bank.shape[:1] + _blocked(bank.shape[1:], fmt), np.uint8)
            for e in range(bank.shape[0]):
                dense = to_f32(bank[e])
                out[e] = quantize_rows(dense, fmt)
                err += float(np.sum((dequantize_ref(out[e]) - dense) ** 2, dtype=np.float64))
                total += float(np.sum(dense.astype(np.float64) ** 2))
            before, after = before + bank.nbytes, after + out.nbytes
            banks.append(out)
        layers[i] = replace(layers[i], gate_up=banks[0], down=banks[1])
    log.info("experts quantized to %s at load: %.2f GB -> %.2f GB, relative RMS error %.2e", fmt,
             before / 1e9, after / 1e9, (err / max(total, 1e-30)) ** 0.5)
    return replace(weights, layers=tuple(layers))


def _blocked(shape: tuple[int, int], fmt: str) -> tuple[int, int, int]:
    """[R, K] -> [R, K/V, B] of fmt; K must be a multiple of V (a clear error otherwise)."""
    from freetoken.kernels.qformats import format_named
    block = format_named("fp8_b128" if fmt == "fp8" else fmt)
    values, nbytes = block.values, block.nbytes
    rows, k = shape
    if k % values:
        from freetoken.config import ConfigError
        raise ConfigError(f"--quantize-experts {fmt}: expert rows of {k} values are not a multiple of {values}")
    return rows, k // values, nbytes
