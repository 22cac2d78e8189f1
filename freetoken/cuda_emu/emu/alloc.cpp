// alloc.cpp -- device allocations: each its own mapping with a PROT_NONE page before and after,
// the block placed so that its end is as close to the trailing guard as 256-byte alignment of its
// start allows (an overrun faults within 255 bytes), and filled with the poison pattern (uint16
// 0xFFC7: NaN as bf16 and as f32) so a read of never-written memory computes NaN. The slack
// between the guards and the block (the alignment padding past its end, and up to kCanary bytes
// before its start) stays poison: emu_check_slack, after each launch, names a write there, which
// no guard page catches. Also the description of a faulting address in terms of these allocations.
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <map>

#include "runtime.h"

namespace emu {

struct Alloc { uintptr_t base; size_t maplen; uintptr_t start; size_t nbytes; };

static pthread_mutex_t g_alloc_mutex = PTHREAD_MUTEX_INITIALIZER;
static std::map<uintptr_t, Alloc> g_allocs;  // by base (first guard page)
constexpr int kFreed = 64;
static Alloc g_freed[kFreed];                // the last frees, to name a use after free
static int g_freed_next;

// The pattern is a function of the address (0xC7 at even bytes, 0xFF at odd), so an odd start
// keeps every aligned uint16 reading 0xFFC7.
void fill_poison(void* p, size_t n) {
  unsigned char* c = static_cast<unsigned char*>(p);
  while (n && ((uintptr_t)c & 7)) *c = ((uintptr_t)c & 1) ? 0xFF : 0xC7, ++c, --n;
  for (; n >= 8; c += 8, n -= 8) memcpy(c, &kPoison64, 8);
  for (; n; ++c, --n) *c = ((uintptr_t)c & 1) ? 0xFF : 0xC7;
}

bool poisoned(const void* p, size_t n) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i)
    if (c[i] != (((uintptr_t)(c + i) & 1) ? 0xFF : 0xC7)) return false;
  return true;
}

constexpr size_t kCanary = 256;              // bytes before a block's start that are checked

static const Alloc* find(uintptr_t addr) {
  auto it = g_allocs.upper_bound(addr);
  if (it == g_allocs.begin()) return nullptr;
  --it;
  return addr < it->second.base + it->second.maplen ? &it->second : nullptr;
}

static void describe(const Alloc& a, uintptr_t addr, const char* what, char* buf, size_t n) {
  if (addr < a.start)
    snprintf(buf, n, "%llu bytes before the start of the %s%zu-byte allocation at 0x%llx",
             (unsigned long long)(a.start - addr), what, a.nbytes, (unsigned long long)a.start);
  else if (addr >= a.start + a.nbytes)
    snprintf(buf, n, "%llu bytes past the end (byte offset %llu) of the %s%zu-byte allocation at "
             "0x%llx", (unsigned long long)(addr - a.start - a.nbytes),
             (unsigned long long)(addr - a.start), what, a.nbytes, (unsigned long long)a.start);
  else
    snprintf(buf, n, "byte offset %llu of the %s%zu-byte allocation at 0x%llx",
             (unsigned long long)(addr - a.start), what, a.nbytes, (unsigned long long)a.start);
}

void describe_allocation(uintptr_t addr, char* buf, size_t n) {
  pthread_mutex_lock(&g_alloc_mutex);
  const Alloc* a = find(addr);
  if (a) describe(*a, addr, "", buf, n);
  for (int i = 0; !a && i < kFreed; ++i) {
    const Alloc& f = g_freed[(g_freed_next + kFreed - 1 - i) % kFreed];
    if (f.maplen && addr >= f.base && addr < f.base + f.maplen) {
      describe(f, addr, "freed ", buf, n);
      a = &f;
    }
  }
  if (!a) snprintf(buf, n, "not in any device allocation");
  pthread_mutex_unlock(&g_alloc_mutex);
}

}  // namespace emu

using namespace emu;

EMU_API void* emu_alloc(size_t nbytes) {
  const size_t page = sysconf(_SC_PAGESIZE);
  const size_t span = ((nbytes + 255) / 256 * 256 + page - 1) / page * page;
  const size_t maplen = span + 2 * page;
  char* base = static_cast<char*>(
      mmap(nullptr, maplen, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (base == MAP_FAILED) return nullptr;
  if (span && mprotect(base + page, span, PROT_READ | PROT_WRITE)) {
    munmap(base, maplen);
    return nullptr;
  }
  fill_poison(base + page, span);
  const uintptr_t start = ((uintptr_t)(base + page + span) - nbytes) & ~(uintptr_t)255;
  pthread_mutex_lock(&g_alloc_mutex);
  g_allocs[(uintptr_t)base] = Alloc{(uintptr_t)base, maplen, start, nbytes};
  pthread_mutex_unlock(&g_alloc_mutex);
  return reinterpret_cast<void*>(start);
}

// 0, or -1 when `p` is not the start of a live allocation (nothing is freed then).
EMU_API int emu_free(void* p) {
  const uintptr_t addr = (uintptr_t)p;
  pthread_mutex_lock(&g_alloc_mutex);
  const Alloc* a = find(addr);
  if (!a || a->start != addr) {
    pthread_mutex_unlock(&g_alloc_mutex);
    return -1;
  }
  const Alloc gone = *a;
  g_allocs.erase(gone.base);
  g_freed[g_freed_next] = gone;
  g_freed_next = (g_freed_next + 1) % kFreed;
  munmap(reinterpret_cast<void*>(gone.base), gone.maplen);
  pthread_mutex_unlock(&g_alloc_mutex);
  return 0;
}

// 0 when the slack around the allocation holding `addr` (if any) is still poison; else 1, a
// description of the lowest changed byte in `buf` (the most negative index before the start,
// the first byte past the end), and the slack poisoned again (one report
// per write).
EMU_API int emu_check_slack(uintptr_t addr, char* buf, size_t n) {
  const size_t page = sysconf(_SC_PAGESIZE);
  int found = 0;
  pthread_mutex_lock(&g_alloc_mutex);
  const Alloc* a = find(addr);
  if (a) {
    const uintptr_t lo = a->start - kCanary < a->base + page ? a->base + page : a->start - kCanary;
    const uintptr_t end = a->start + a->nbytes, hi = a->base + a->maplen - page;
    uintptr_t bad = 0;
    for (uintptr_t c = lo; !bad && c < a->start; ++c)
      if (!poisoned((void*)c, 1)) bad = c;
    for (uintptr_t c = end; !bad && c < hi; ++c)
      if (!poisoned((void*)c, 1)) bad = c;
    if (bad) {
      describe(*a, bad, "", buf, n);
      fill_poison((void*)lo, a->start - lo);
      fill_poison((void*)end, hi - end);
      found = 1;
    }
  }
  pthread_mutex_unlock(&g_alloc_mutex);
  return found;
}

