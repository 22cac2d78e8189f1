"""--host-scratch-reuse: glibc malloc keeps the scratch a prompt freed, so the next one does not
page-fault it in again (engine/host_malloc.py)."""
import json
import logging
import platform
import subprocess
import sys

import pytest

from freetoken import LLM

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# a prompt's scratch, three times: three 20 MB arrays alive at once, written, then freed; each
# round's minor page faults (a fault maps 4 KB or more: numpy asks for huge pages)
_ROUNDS = """
import json, logging, resource, sys
import numpy as np
if sys.argv[1] == "on":
    from freetoken.engine.host_malloc import reuse_freed_scratch
    reuse_freed_scratch(logging.getLogger("t"))
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.empty(20 << 20, np.uint8) for _ in range(3)]
    for a in arrays:
        a[::4096] = 1
    del arrays, a
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def _faults(mode: str) -> list:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_later_rounds_reuse_the_freed_pages():
    on = _faults("on")
    assert max(on[1:]) * 20 < on[0], on          # under 5% of the first round's faults again


@glibc_only
def test_glibc_defaults_fault_the_same_rounds_in_again():
    """What the setting is for: without it the same rounds fault most of their pages again."""
    off = _faults("off")
    assert min(off[1:]) * 2 > off[0], off


def test_the_engine_says_what_it_did_and_the_flag_turns_it_off(caplog):
    with caplog.at_level(logging.INFO, logger="freetoken"):
        LLM("synth:tiny", backend="cpu", max_model_len=64)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("host malloc:")]
    assert len(lines) == 1, lines
    if platform.libc_ver()[0] == "glibc":
        assert "32 MB from the heap and 64 MB kept" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="freetoken"):
        LLM("synth:tiny", backend="cpu", max_model_len=64, host_scratch_reuse=False)
    assert not [r for r in caplog.records if r.getMessage().startswith("host malloc:")]


@glibc_only
def test_this_process_mallocs_with_glibc():
    from freetoken.engine import host_malloc
    assert "libc.so" in host_malloc.malloc_library()


@glibc_only
def test_another_allocator_is_left_alone(monkeypatch):
    """jemalloc or tcmalloc preloaded: glibc's mallopt would accept and change nothing; say so."""
    from freetoken.engine import host_malloc
    monkeypatch.setattr(host_malloc, "malloc_library", lambda: "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    monkeypatch.setattr(host_malloc.ctypes, "CDLL", None)         # mallopt must not be reached
    assert "malloc comes from /usr/lib/x86_64-linux-gnu/libjemalloc.so.2" in host_malloc._set_parameters()


_INTERPOSER = r"""
#include <stddef.h>
extern void *__libc_malloc(size_t); extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t); extern void *__libc_realloc(void *, size_t);
void *malloc(size_t n) { return __libc_malloc(n); }
void free(void *p) { __libc_free(p); }
void *calloc(size_t a, size_t b) { return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { return __libc_realloc(p, n); }
"""


@glibc_only
def test_a_preloaded_malloc_is_found(tmp_path):
    """A real LD_PRELOAD allocator (a forwarder to glibc's, built here) is named in the log line."""
    import os
    import shutil
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a preloaded malloc")
    (tmp_path / "m.c").write_text(_INTERPOSER)
    lib = tmp_path / "libforward_malloc.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(tmp_path / "m.c")], check=True)
    code = ("import logging; from freetoken.engine.host_malloc import reuse_freed_scratch; "
            "print(reuse_freed_scratch(logging.getLogger('t')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, LD_PRELOAD=str(lib)))
    assert f"malloc comes from {lib}" in out.stdout, out.stdout + out.stderr
