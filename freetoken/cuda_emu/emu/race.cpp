// race.cpp -- shared-memory race detection (compute-sanitizer racecheck's idea). A kernel built
// in race mode (device_code.py, FREETOKEN_CUDA_EMULATE_RACES=1) is compiled with GCC's
// -fsanitize=thread instrumentation but without its runtime: every load and store calls the
// __tsan_* hooks below (as sync.cpp's hooks stand in for libubsan). Those outside the block's
// shared memory return at once; for shared bytes a shadow keeps the last write and up to two
// reads: (interval, thread, its warp's interval, code address).
//
// Two accesses by different threads to one byte, at least one a write, race unless something
// orders them: a __syncthreads between them (the block interval changed), or, within one warp, a
// warp operation (shuffle, vote, __syncwarp) between them. A race is a fault naming both
// accesses' code addresses as {{pc:LIB+0xOFF}}, which device_code.py turns into file:line.
// Atomics (cuda_emu.h) are not instrumented: they never race with each other.
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "runtime.h"

namespace emu {

struct Access {
  uint64_t interval;       // 0: none
  uint64_t warp_interval;  // of the accessing thread's warp then
  const void* pc;
  int tid;
};
struct Shadow { Access write, read[2]; };

static uint64_t g_serial = 1;              // source of fresh interval numbers
static uint64_t g_block_interval;          // since the last __syncthreads (or the block start)
static uint64_t g_warp_interval[kMaxThreads / 32];
static std::vector<Shadow> g_static_shadow, g_dyn_shadow;
static const char* g_dyn_lo;
static size_t g_dyn_len;

void race_block_start(char* dyn, size_t dyn_len) {
  g_block_interval = ++g_serial;
  for (auto& w : g_warp_interval) w = ++g_serial;
  const size_t static_len = g_args->static_hi - g_args->static_lo;
  if (g_static_shadow.size() < static_len) g_static_shadow.resize(static_len);
  if (g_dyn_shadow.size() < dyn_len) g_dyn_shadow.resize(dyn_len);
  g_dyn_lo = dyn, g_dyn_len = dyn_len;
}

void race_barrier() { g_block_interval = ++g_serial; }
void race_warp_sync(int warp) { g_warp_interval[warp] = ++g_serial; }

static bool ordered(const Access& a, int tid) {
  return a.interval != g_block_interval || a.tid == tid ||
         (a.tid / 32 == tid / 32 && a.warp_interval != g_warp_interval[tid / 32]);
}

static int describe_pc(const void* pc, char* buf, size_t n) {
  Dl_info info;
  if (pc && dladdr(pc, &info) && info.dli_fname)
    return snprintf(buf, n, "{{pc:%s+0x%llx}}", info.dli_fname,
                    (unsigned long long)((const char*)pc - (const char*)info.dli_fbase - 1));
  return snprintf(buf, n, "{{pc:unknown}}");
}

[[noreturn]] static void report(const char* kind, const char* where, size_t offset,
                                const Access& before, const char* before_op, const void* pc,
                                const char* op) {
  const Dim3 d = emu_block_dim;
  const int t = before.tid;
  char first[768], second[768];
  describe_pc(before.pc, first, sizeof first);
  describe_pc(pc, second, sizeof second);
  fault_in_fiber(F_RACE, "shared-memory race (%s) on byte %zu of %s: thread (%d,%d,%d) %s it at "
                 "%s, then this thread %s it at %s with no __syncthreads between", kind, offset,
                 where, t % (int)d.x, t / (int)d.x % (int)d.y, t / (int)(d.x * d.y), before_op,
                 first, op, second);
}

static Shadow* shadow_of(const char* p, const char** where, size_t* offset) {
  if (p >= g_args->static_lo && p < g_args->static_hi) {
    *where = "static shared memory", *offset = p - g_args->static_lo;
    return &g_static_shadow[*offset];
  }
  if (p >= g_dyn_lo && p < g_dyn_lo + g_dyn_len) {
    *where = "dynamic shared memory", *offset = p - g_dyn_lo;
    return &g_dyn_shadow[*offset];
  }
  return nullptr;
}

static void on_access(const void* addr, size_t n, bool write, const void* pc) {
  if (!g_cur) return;
  const int tid = g_cur->tid;
  const Access me{g_block_interval, g_warp_interval[tid / 32], pc, tid};
  for (size_t i = 0; i < n; ++i) {
    const char* where;
    size_t offset;
    Shadow* s = shadow_of(static_cast<const char*>(addr) + i, &where, &offset);
    if (!s) return;               // an access lies in one region or in none
    if (s->write.interval && !ordered(s->write, tid))
      report(write ? "write after write" : "read after write", where, offset, s->write, "wrote",
             pc, write ? "writes" : "reads");
    if (write) {
      for (const Access& r : s->read)
        if (r.interval && !ordered(r, tid))
          report("write after read", where, offset, r, "read", pc, "writes");
      s->write = me;
      s->read[0].interval = s->read[1].interval = 0;
    } else {  // keep two readers: any later writer is unordered with one of them if with any
      Access* slot = (s->read[0].tid == tid || s->read[0].interval != g_block_interval) ? &s->read[0]
                   : (s->read[1].tid == tid || s->read[1].interval != g_block_interval) ? &s->read[1]
                   : nullptr;
      if (slot) *slot = me;
    }
  }
}

}  // namespace emu

using namespace emu;

// GCC's -fsanitize=thread calls (no libtsan is linked). Sizes 1..16, aligned or not.
#define EMU_TSAN(N)                                                                            \
  EMU_API void __tsan_read##N(void* p) { on_access(p, N, false, __builtin_return_address(0)); } \
  EMU_API void __tsan_write##N(void* p) { on_access(p, N, true, __builtin_return_address(0)); } \
  EMU_API void __tsan_unaligned_read##N(void* p) {                                             \
    on_access(p, N, false, __builtin_return_address(0)); }                                     \
  EMU_API void __tsan_unaligned_write##N(void* p) {                                            \
    on_access(p, N, true, __builtin_return_address(0)); }
EMU_TSAN(1)
EMU_TSAN(2)
EMU_TSAN(4)
EMU_TSAN(8)
EMU_TSAN(16)
EMU_API void __tsan_read_range(void* p, size_t n) { on_access(p, n, false, __builtin_return_address(0)); }
EMU_API void __tsan_write_range(void* p, size_t n) { on_access(p, n, true, __builtin_return_address(0)); }
EMU_API void __tsan_func_entry(void*) {}
EMU_API void __tsan_func_exit() {}
EMU_API void __tsan_init() {}
