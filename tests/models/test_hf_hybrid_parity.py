"""The Gated DeltaNet hybrids against Hugging Face transformers (fixtures: tests/fixtures/hf/,
written by tests/fixtures/make_gdn_fixtures.py): Qwen3.5-MoE text-only (tied embeddings),
Qwen3.5-MoE inside its vision wrapper (weights under model.language_model., vision tensors skipped)
and Qwen3-Next (packed in_proj_qkvz / in_proj_ba). fp32 logits at every prompt and decode position
within 2e-4 of transformers' fp32 (the Qwen3-MoE fixtures' tolerance; measured <= 1.4e-4) and
the 32 greedy tokens identical, on ref and cpu. Bad checkpoints fail at load naming the tensor."""
import shutil
from pathlib import Path

import numpy as np
import pytest

from freetoken import LLM
from freetoken.models.weights import SafetensorsFile, WeightsError, save_safetensors
from tests.models.test_gguf import matches_transformers

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
HYBRIDS = ["qwen35moe_text", "qwen35moe_vl", "qwen3next"]


def check_fixture(name: str, backend: str, **options) -> None:
    d = FIXTURES / name / "fp32"
    matches_transformers(d, np.load(d / "expected.npz"), backend, **options)


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("name", HYBRIDS)
def test_fp32_logits_and_greedy_tokens(name, backend):
    check_fixture(name, backend)


@pytest.mark.parametrize("moe", [dict(moe_backend="cpu"), dict(moe_backend="offload", moe_cache_rate=0.5),
                                 dict(moe_backend="hybrid", moe_cache_rate=0.5, moe_fetch_fraction=0.3)],
                         ids=["cpu", "offload", "hybrid"])
def test_every_moe_backend_on_a_hf_hybrid(moe):
    check_fixture("qwen35moe_text", "cpu", chunked_prefill_size=7, **moe)


def _broken_copy(tmp_path, change) -> Path:
    src = FIXTURES / "qwen35moe_text" / "fp32"
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    f = SafetensorsFile(dst / "model.safetensors")
    tensors = {n: np.array(f.get(n)) for n in f.entries}
    del f
    change(tensors)
    save_safetensors(dst / "model.safetensors", tensors)
    return dst


def test_a_missing_tensor_is_named(tmp_path):
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    d = _broken_copy(tmp_path, lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=r"missing tensor 'model\.layers\.0\.linear_attn\.in_proj_z\.weight'"):
        LLM(str(d), backend="cpu")


def test_a_wrong_shape_is_named_with_both_shapes(tmp_path):
    name = "model.layers.0.linear_attn.A_log"
    d = _broken_copy(tmp_path, lambda t: t.__setitem__(name, np.zeros(3, np.float32)))
    with pytest.raises(WeightsError, match=r"A_log.*expected \(4,\), found \(3,\)"):
        LLM(str(d), backend="cpu")
