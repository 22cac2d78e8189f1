#!/usr/bin/env bash
# Fit the tree the device tool sends (at most 64 MiB, wheels included) for bench/gpu_check.sh: leave
# behind the weights no gpu test reads, then put them back.
#
#   bash bench/gpu_trim.sh leave      (before the device call: prints the size that will travel)
#   bash bench/gpu_trim.sh restore    (after it: `git checkout` of the same paths)
#
# The list was read off an emulated `pytest -m gpu` run (every file it opened) on 2026-12-06 (the
# built-in gpt-oss of 2026-12-07 added: no gpu test reads it). Keep
# every tokenizer.json: the Rust tokenizer opens it outside Python, so such a trace misses it. The
# FP8 fixture with f32 scales stays behind too (its two cuda cases are deselected by gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."
FIX=tests/fixtures
LEAVE=(
  freetoken/data/tiny-agent-hybrid/model.safetensors freetoken/data/tiny-agent-oss/model.safetensors
  $FIX/gguf/qwen35moe-f32.gguf $FIX/gguf/qwen3moe_norm-f32.gguf $FIX/gguf/qwen3next-f32.gguf
  $FIX/gguf/qwen3next-f32.expected.npz
  $FIX/gguf/qwen35moe-q8_0-fused.gguf $FIX/gguf/qwen3moe_norm-q8_0-fused.gguf
  $FIX/hf/qwen35moe_vl/fp32/expected.npz $FIX/hf/qwen35moe_vl/fp32/model.safetensors
  $FIX/hf/qwen3moe_fp8/bf16_scales/dequantized.npz
  $FIX/hf/qwen3moe_fp8/bf16_scales/expected_transformers_as_loaded.npz
  $FIX/hf/qwen3moe_fp8/f32_scales/dequantized.npz $FIX/hf/qwen3moe_fp8/f32_scales/expected.npz
  $FIX/hf/qwen3moe_fp8/f32_scales/expected_transformers_as_loaded.npz
  $FIX/hf/qwen3moe_fp8/f32_scales/model.safetensors
  $FIX/hf/qwen3moe_nonorm/bf16/expected.npz $FIX/hf/qwen3moe_nonorm/bf16/model-0000{1,2,3}-of-00003.safetensors
  $FIX/hf/qwen3moe_norm/bf16/model.safetensors
)
case ${1:-} in
  leave) rm -f "${LEAVE[@]}" ;;
  restore) git checkout -- "${LEAVE[@]}" ;;
  *) echo "usage: bash bench/gpu_trim.sh leave|restore" >&2; exit 2 ;;
esac
# What travels: tracked files present, untracked ones git does not ignore, and bench/wheels (carried)
bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | { xargs -0 stat -c %s 2>/dev/null || true; } \
  | awk '{s += $1} END {print s}')
wheels=$(du -sb bench/wheels 2>/dev/null | cut -f1)
echo "gpu_trim: $1; the tree $((bytes / 1000000)) MB + bench/wheels $((${wheels:-0} / 1000000)) MB (limit 67 MB)"
