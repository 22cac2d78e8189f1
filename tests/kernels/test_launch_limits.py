"""kernels/launch_limits.py: cuda/launch_limits.json is what real ptxas reports now (recompiled
with NVRTC, no GPU); device_limits.py: the rules a device refuses launches by."""
import pytest

from freetoken import device_limits as dl
from freetoken.kernels import _nvrtc, launch_limits as ll, router

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'router_f32' for 'sm_90'
ptxas info    : Function properties for router_f32
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 31 registers, used 1 barriers, 640 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'experts_down_q' for 'sm_90'
ptxas info    : Function properties for experts_down_q
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 68 registers, used 0 barriers
"""


def test_parse_reads_each_entry():
    assert ll.parse(LOG) == {
        "router_f32": {"registers": 31, "static_smem": 640, "stack": 8, "spills": 8},
        "experts_down_q": {"registers": 68, "static_smem": 0, "stack": 0, "spills": 0}}


def test_the_committed_table_is_what_ptxas_says_now():
    """Every cuda/*.cu (every format of the quantized ones) for sm_80, sm_90 and sm_120; on a
    mismatch: python -m freetoken.kernels.launch_limits --write."""
    if _nvrtc.nvrtc() is None:
        pytest.skip("libnvrtc not found (pip install 'nvidia-cuda-nvrtc==13.0.*')")
    fresh = ll.measure()
    assert fresh == dl.table(), "cuda/launch_limits.json is stale: python -m freetoken.kernels.launch_limits --write"
    assert all(set(row["registers"]) == set(dl.ARCHS) for row in fresh.values())


def test_registers_are_allocated_in_eights_per_group_of_four_warps():
    assert dl.block_registers(120, 1024) == 120 * 1024
    assert dl.block_registers(115, 1024) == 120 * 1024
    assert dl.block_registers(31, 33) == 32 * 128
    assert dl.block_registers(113, 544) == 120 * 640 > dl.REGISTERS_PER_BLOCK


def test_gdn_rule_takes_the_block_an_h200_reported():
    """An H200's max_threads_per_block for gdn_rule_f32 at 113 registers was 512 (2026-12-04)."""
    assert dl.max_threads("gdn_rule_f32") == 512


def test_refusals_name_the_limit():
    gdn = max(dl.table()["gdn_rule_f32"]["registers"].values())
    assert dl.refusal("gdn_rule.cu", "gdn_rule_f32", dl.max_threads("gdn_rule_f32"), 0, 0) is None
    why = dl.refusal("gdn_rule.cu", "gdn_rule_f32", 1024, 0, 0)
    assert why.startswith(dl.TOO_MANY_REGISTERS) and f"1024 threads x {gdn} registers" in why
    fits = 4 * router.MAX_E
    assert dl.refusal("router.cu", "router_f32", 256, fits, 0) is None
    why = dl.refusal("router.cu", "router_f32", 256, fits + 4, 0)
    assert why.startswith(dl.TOO_MUCH_SHARED) and "640 bytes of static shared memory" in why
    assert "48 KiB without" in why
    assert dl.refusal("router.cu", "router_f32", 256, fits + 4, fits + 4) is None    # opted in
    assert dl.refusal("mine.cu", "router_f32", 1024, 10**6, 0) is None               # not ours
    assert dl.refusal("router.cu", "no_such_entry", 1024, 10**6, 0) is None
