"""Device code of the emulated CUDA device: a .cu source (the text CuPy's RawModule would get) is
built for the host by g++ with emu/cuda_emu.h force-included, each ``extern "C" __global__`` entry
reached through a generated trampoline, and launched on the fiber runtime (emu/*.cpp, one shared
library): one fiber per CUDA thread, blocks one after another, the real grid, block and dynamic
shared-memory size. Device memory comes from ``alloc``: guard-paged and poison-filled.

Faults are loud, as EmuFault naming the kernel: a launch shape the device would reject, an access
outside any allocation (guard pages), an out-of-bounds index into a fixed-size array (static
shared memory included; -fsanitize=bounds), a dynamic shared-memory overrun, a barrier not every
thread reaches, a warp operation whose mask names an exited lane.

Also seen: a write into the slack around an allocation a kernel was passed (its alignment
padding past the end, the 256 bytes before its start: poison checked after the launch), a write
at a negative index of dynamic shared memory (256 poisoned bytes before it), and a launch a real
GPU refuses for its registers or its static + dynamic shared memory (freetoken/device_limits.py,
ptxas's numbers).

Races on shared memory, in race mode (FREETOKEN_CUDA_EMULATE_RACES=1, emu/race.cpp): two
threads' accesses to one byte, one a write, with no __syncthreads between them (nor, within a
warp, a warp operation), named with both accesses' file:line.

Not seen: races outside race mode (threads run one at a time between barriers and warp
operations, so a racy kernel computes a serial answer, and blocks run in order), races on
global memory, a read of the slack (it reads poison), an underrun further than 256 bytes but
within the first page, pointer arithmetic past a static shared array (only indexing is
checked), an endless loop (it hangs). Numerics are the host's: glibc expf/sincosf, no FMA
contraction, no flush-to-zero.

Builds are cached in ``env.home()/cuda_emu``, keyed by the code, every header it includes, the
runtime's sources, the compiler and the flags. Kernel classes live in device_launch.py.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from freetoken import env
from freetoken.env import flag

POISON16 = 0xFFC7                      # NaN as bf16 and as f32 (high half), every fresh word
MAX_THREADS = 1024
MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = (2**31 - 1, 65535, 65535)
DEFAULT_SMEM = 48 * 1024               # without the max_dynamic_shared_size_bytes opt-in
OPTIN_SMEM = 227 * 1024                # sm_90's opt-in maximum

EMU_DIR = Path(__file__).resolve().parent / "emu"
SHIM = EMU_DIR / "cuda_emu.h"
RUNTIME_SOURCES = ("runtime.cpp", "launch.cpp", "sync.cpp", "alloc.cpp", "race.cpp")
RUNTIME_FILES = ("cuda_emu.h", "runtime.h", "shared.ld") + RUNTIME_SOURCES
CXX = "g++"
RUNTIME_FLAGS = ("-std=c++17", "-O2", "-g", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden",
                 "-Wl,--no-undefined")
# -O1: the kernels build in seconds and still run well; -ffp-contract=off: no FMA contraction,
# so __fmul_rn and friends round like CUDA's; bounds: static shared (and local) array indices;
# alignment: an access through a pointer its type's alignment does not divide (vector types
# carry CUDA's __align__);
# data sections + shared.ld: the static __shared__ variables in one section (see shared.ld).
KERNEL_FLAGS = ("-O1", "-g", "-fPIC", "-shared", "-fvisibility=hidden", "-fsanitize=bounds,alignment",
                "-ffp-contract=off", "-fno-strict-aliasing", "-fno-threadsafe-statics",
                "-fno-math-errno", "-fdata-sections", f"-Wl,-T,{EMU_DIR / 'shared.ld'}",
                "-fstack-clash-protection")  # big frames probe each page: overflows hit the guard
# Race mode: every load and store reports to emu/race.cpp, which checks shared memory.
RACE_FLAGS = ("-fsanitize=thread", "-gdwarf-4")   # DWARF 4: addr2line names #line files right


def races() -> bool:
    """Whether kernels are built for race detection (FREETOKEN_CUDA_EMULATE_RACES=1)."""
    return flag("CUDA_EMULATE_RACES")


def fuzz_seed() -> int:
    """FREETOKEN_CUDA_EMULATE_FUZZ: a seed for the schedule fuzz (threads of a block in a random
    runnable order, blocks in a random order; emu/runtime.cpp), 0 or unset for the plain order."""
    raw = os.environ.get("FREETOKEN_CUDA_EMULATE_FUZZ", "").strip() or "0"
    if not raw.isdigit():
        raise ValueError(f"FREETOKEN_CUDA_EMULATE_FUZZ={raw!r}: a non-negative integer seed")
    return int(raw)


def set_fuzz(seed: int) -> None:
    """Schedule fuzz from now on with ``seed`` (0: off), whatever the environment said."""
    _runtime().emu_set_fuzz(int(seed))


class EmuFault(RuntimeError):
    """A fault of an emulated kernel (or of its launch); ``address`` for memory faults."""

    def __init__(self, message: str, kernel: str = "", address: int | None = None):
        super().__init__(message)
        self.kernel, self.address = kernel, address


class CompileError(RuntimeError):
    """g++ rejected the source; the message carries its diagnostics."""


# --- building ------------------------------------------------------------------------------------

def _cache_dir() -> Path:
    return env.home() / "cuda_emu"


@functools.cache
def _compiler_id() -> str:
    try:
        return subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CompileError(f"the emulated CUDA device builds kernels with {CXX}, which does not "
                           f"run here: {e}") from e


def _key(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _compile(args: list[str], out: Path, stdin: str | None = None) -> None:
    """g++ ``args`` into ``out`` through a temporary file renamed into place, so concurrent
    builders of one key never see a partial library."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([CXX, *args, "-o", tmp], input=stdin, capture_output=True, text=True)
        if r.returncode:
            raise CompileError(f"{CXX} failed ({r.returncode}) building {out.name}:\n{r.stderr}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_lock = threading.Lock()


@functools.cache
def _runtime_key() -> str:
    texts = [(EMU_DIR / f).read_text() for f in RUNTIME_FILES]
    return _key(*texts, _compiler_id(), *RUNTIME_FLAGS)


def _runtime() -> ctypes.CDLL:
    """The runtime library, built on first use and loaded RTLD_GLOBAL: kernel libraries resolve
    threadIdx, the barrier and the bounds-sanitizer hooks against it when they are loaded."""
    with _lock:
        return _load_runtime()


@functools.cache
def _load_runtime() -> ctypes.CDLL:
    path = _cache_dir() / f"runtime-{_runtime_key()}.so"
    if not path.exists():
        _compile([*RUNTIME_FLAGS, *(str(EMU_DIR / s) for s in RUNTIME_SOURCES)], path)
    lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    lib.emu_alloc.restype, lib.emu_alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    lib.emu_free.restype, lib.emu_free.argtypes = ctypes.c_int, [ctypes.c_void_p]
    lib.emu_set_fuzz.restype, lib.emu_set_fuzz.argtypes = None, [ctypes.c_ulonglong]
    lib.emu_set_fuzz(fuzz_seed())
    lib.emu_check_slack.restype = ctypes.c_int
    lib.emu_check_slack.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.emu_launch.restype = ctypes.c_int
    lib.emu_launch.argtypes = [ctypes.POINTER(_LaunchArgs), ctypes.POINTER(_FaultInfo)]
    return lib


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def _headers(text: str, here: Path | None, dirs: list[Path], seen: dict[Path, str]) -> None:
    """Every header ``text`` includes with quotes, recursively, resolved like g++ does (the
    including file's folder, then the -I folders), into ``seen`` (path -> text)."""
    for name in _INCLUDE.findall(text):
        for d in ([here] if here else []) + dirs:
            p = (d / name).resolve()
            if p.is_file():
                if p not in seen:
                    seen[p] = p.read_text()
                    _headers(seen[p], p.parent, dirs, seen)
                break


def _flags(options) -> tuple[list[str], list[Path]]:
    """The g++ flags of RawModule ``options`` (-std, -I, -D kept; NVRTC-only ones dropped)."""
    flags, dirs, std = [], [], "-std=c++17"
    for o in options:
        if o.startswith(("-I", "--include-path=")):
            d = Path(o.split("=", 1)[1] if o.startswith("--") else o[2:])
            dirs.append(d)
            flags.append(f"-I{d}")
        elif o.startswith(("-D", "--define-macro=")):
            flags.append("-D" + (o.split("=", 1)[1] if o.startswith("--") else o[2:]))
        elif re.fullmatch(r"-std=c\+\+\d\d", o):
            std = o
    return [std, *flags], dirs


# extern __shared__ T name[];  ->  a reference to the runtime's pointer to this launch's buffer
# (newlines kept, so the #line numbering of the file stays right)
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+([^;\[\]]*?)\s*\b(\w+)\s*\[\s*\]\s*;")


def _rewrite(code: str) -> str:
    def sub(m):
        ctype = re.sub(r"__align__\s*\(\s*\d+\s*\)", " ", m.group(1)).strip()
        return (f"{ctype}* const& {m.group(2)} = reinterpret_cast<{ctype}* const&>(emu_dyn_smem);"
                + "\n" * m.group(0).count("\n"))
    return _EXTERN_SHARED.sub(sub, code)


def _trailer(entries) -> str:
    """Appended to the source: the static-shared section's bounds and one trampoline per entry."""
    lines = ['#line 1 "<cuda_emu trampolines>"',
             'extern "C" char emu_shared_lo[], emu_shared_hi[];  // defined by shared.ld',
             'extern "C" __attribute__((visibility("default"))) void emu_shared_section('
             'char** lo, char** hi) { *lo = emu_shared_lo; *hi = emu_shared_hi; }']
    lines += [f'extern "C" __attribute__((visibility("default"))) void emu_entry_{e}(void** p) '
              f'{{ emu::invoke({e}, p); }}' for e in entries]
    return "\n".join(lines) + "\n"


_modules: dict[str, "Module"] = {}


def build(code: str, options: tuple[str, ...] = ()) -> "Module":
    """The module of ``code`` built with RawModule ``options``; cached on disk and in process."""
    from freetoken.cuda_emu.device_launch import Module, entries
    flags, dirs = _flags(options)
    found = entries(code)
    seen: dict[Path, str] = {}
    _headers(code, None, dirs, seen)
    key = _key(code, *(f"{p}\n{t}" for p, t in sorted(seen.items())), _runtime_key(),
               _compiler_id(), *KERNEL_FLAGS, *flags, *(RACE_FLAGS if races() else ()))
    with _lock:
        if key in _modules:
            return _modules[key]
    runtime = _runtime()
    path = _cache_dir() / f"kernel-{key}.so"
    if not path.exists():
        source = _rewrite(code) + "\n" + _trailer(found)
        if races():      # instrumented, then linked without libtsan: race.cpp has the hooks
            obj = path.with_suffix(".o")
            _compile([*flags, *KERNEL_FLAGS, *RACE_FLAGS, "-c", "-include", str(SHIM), "-x", "c++", "-"],
                     obj, source)
            _compile(["-shared", f"-Wl,-T,{EMU_DIR / 'shared.ld'}", str(obj)], path)
            obj.unlink()
        else:
            _compile([*flags, *KERNEL_FLAGS, "-include", str(SHIM), "-x", "c++", "-"], path, source)
    module = Module(path, found, code, runtime)
    with _lock:
        return _modules.setdefault(key, module)


_PC = re.compile(r"\{\{pc:(.+?)\+0x([0-9a-f]+)\}\}")


def symbolize(message: str) -> str:
    """A race report's code addresses ({{pc:LIB+0xOFF}}, emu/race.cpp) as file:line, the
    innermost inlined function first and, when the code was inlined, where into."""
    def where(m):
        try:
            out = subprocess.run(["addr2line", "-e", m.group(1), "-f", "-C", "-i", f"0x{m.group(2)}"],
                                 capture_output=True, text=True, timeout=30).stdout.split("\n")
        except (OSError, subprocess.SubprocessError):
            return m.group(0)
        frames = [(out[i].split("(")[0], out[i + 1].split(" ")[0]) for i in range(0, len(out) - 1, 2)]
        if not frames:
            return m.group(0)
        text = f"{frames[0][1]} ({frames[0][0]})"
        return text + (f", inlined at {frames[-1][1]}" if len(frames) > 1 else "")
    return _PC.sub(where, message)


# --- device memory ---------------------------------------------------------------------------------

def alloc(nbytes: int) -> int:
    """A device allocation of ``nbytes`` (0 allowed): 256-byte aligned, poison-filled, with a
    PROT_NONE page before it and one right after its end (within 255 bytes)."""
    if nbytes < 0:
        raise ValueError(f"alloc of {nbytes} bytes")
    addr = _runtime().emu_alloc(int(nbytes))
    if not addr:
        raise MemoryError(f"emulated device: cannot map {nbytes} bytes")
    return int(addr)


def slack_write(addr: int) -> str | None:
    """How a launch wrote into the poisoned slack around the allocation holding ``addr`` (the
    alignment padding past its end, the 256 bytes before its start), or None."""
    buf = ctypes.create_string_buffer(256)
    if _runtime().emu_check_slack(int(addr), buf, len(buf)):
        return buf.value.decode(errors="replace")
    return None


def free(addr: int) -> None:
    if _runtime().emu_free(int(addr)):
        raise ValueError(f"0x{int(addr):x} is not the start of a live device allocation")


# Mirrors emu/runtime.h LaunchArgs and FaultInfo.
class _LaunchArgs(ctypes.Structure):
    _fields_ = [("entry", ctypes.c_void_p), ("params", ctypes.c_void_p),
                ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_ulonglong), ("static_lo", ctypes.c_void_p),
                ("static_hi", ctypes.c_void_p), ("name", ctypes.c_char_p)]


class _FaultInfo(ctypes.Structure):
    _fields_ = [("address", ctypes.c_ulonglong), ("has_address", ctypes.c_int),
                ("kind", ctypes.c_int), ("message", ctypes.c_char * 2048)]
