// sync.cpp -- __syncthreads as a real barrier of the block's fibers, warp shuffles/votes/syncwarp
// as a rendezvous of the lanes their mask names, __trap, and the -fsanitize=bounds hooks.
// Whatever CUDA leaves undefined and this can see is a fault: a barrier some threads never reach
// (they exited, wait at another __syncthreads or in a warp operation), a mask naming an exited
// or missing lane, lanes of one mask in different warp operations.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime.h"

namespace emu {

static const char* const kOpNames[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                       "__shfl_xor_sync", "__ballot_sync", "__any_sync",
                                       "__all_sync", "__syncwarp", "__activemask"};
enum { OP_IDX, OP_UP, OP_DOWN, OP_XOR, OP_BALLOT, OP_ANY, OP_ALL, OP_SYNC, OP_ACTIVE };

// --- barriers -----------------------------------------------------------------------------------
// Called by the scheduler when no fiber can run and some have not exited.
bool resolve_stall() {
  Block& b = g_block;
  if (b.bar_waiting == b.n) {  // everyone arrived: release them in thread order
    b.bar_result = b.bar_count;
    b.bar_waiting = b.bar_count = 0;
    for (int w = 0; w < (b.n + 31) / 32; ++w) b.warps[w].at_bar = 0;
    for (int t = 0; t < b.n; ++t) wake(t);
    race_barrier();
    return true;
  }
  int first_gone = -1, first_warp = -1;
  for (int t = b.n - 1; t >= 0; --t) {
    if (fiber(t)->state == EXITED) first_gone = t;
    if (fiber(t)->state == WAIT_WARP) first_warp = t;
  }
  const int in_warp_ops = b.n - b.exited - b.bar_waiting;
  if (in_warp_ops == 0) {
    set_fault(F_BARRIER, "barrier divergence: %d thread(s) wait at __syncthreads (%s:%d) that "
              "%d thread(s) exited without reaching (the first: linear thread id %d)",
              b.bar_waiting, b.bar_file, b.bar_line, b.exited, first_gone);
    return false;
  }
  const Lane& l = b.warps[first_warp / 32].lane[first_warp % 32];
  if (b.bar_waiting)
    set_fault(F_BARRIER, "barrier divergence / deadlock: %d thread(s) wait at __syncthreads "
              "(%s:%d), %d in warp operations (the first: linear thread id %d in %s, mask "
              "0x%08x), %d exited", b.bar_waiting, b.bar_file, b.bar_line, in_warp_ops,
              first_warp, kOpNames[l.op], l.mask, b.exited);
  else
    set_fault(F_WARP, "deadlock: %d thread(s) wait in warp operations whose lanes never arrive "
              "(the first: linear thread id %d in %s, mask 0x%08x)", in_warp_ops, first_warp,
              kOpNames[l.op], l.mask);
  return false;
}

}  // namespace emu

using namespace emu;

EMU_API int emu_syncthreads(const char* file, int line, int pred) {
  Block& b = g_block;
  if (b.bar_waiting == 0) {
    b.bar_file = file;
    b.bar_line = line;
  } else if (line != b.bar_line || (file != b.bar_file && strcmp(file, b.bar_file) != 0)) {
    fault_in_fiber(F_BARRIER, "barrier divergence: __syncthreads at %s:%d while %d thread(s) "
                   "wait at the one at %s:%d", file, line, b.bar_waiting, b.bar_file, b.bar_line);
  }
  b.bar_waiting++;
  b.bar_count += pred;
  g_cur->state = WAIT_BAR;
  b.warps[g_cur->tid / 32].at_bar |= 1u << (g_cur->tid & 31);
  settle_active(g_cur->tid / 32);
  yield_fiber();
  return b.bar_result;
}

// --- warp operations ----------------------------------------------------------------------------
// Source lane of a shuffle, as PTX shfl.sync computes it: segments of `width` lanes, and a source
// outside the segment's clamp reads the lane's own value.
static int shfl_source(int op, int lane, int arg, int width) {
  const int seg = 32 - width, lo = lane & seg;
  const int hi = op == OP_UP ? lo : lo | (31 & ~seg);
  switch (op) {
    case OP_UP: return lane - arg >= hi ? lane - arg : lane;
    case OP_DOWN: return lane + arg <= hi ? lane + arg : lane;
    case OP_XOR: return (lane ^ arg) <= hi ? lane ^ arg : lane;
    default: { const int j = lo | (arg & 31 & ~seg); return j <= hi ? j : lane; }
  }
}

static void check_warp_op(const Warp& w, int lane, int op, unsigned mask, int width) {
  const char* name = kOpNames[op];
  if (!(mask >> lane & 1u))
    fault_in_fiber(F_WARP, "%s with mask 0x%08x, which leaves out the calling lane %d", name,
                   mask, lane);
  if (mask & ~w.present)
    fault_in_fiber(F_WARP, "%s mask 0x%08x names lanes 0x%08x that do not exist (a partial warp "
                   "of the block)", name, mask, mask & ~w.present);
  if (mask & w.exited)
    fault_in_fiber(F_WARP, "%s mask 0x%08x names lanes 0x%08x that have exited", name, mask,
                   mask & w.exited);
  if (op <= OP_XOR && (width < 1 || width > 32 || (width & (width - 1))))
    fault_in_fiber(F_WARP, "%s width %d is not a power of two in [1, 32]", name, width);
}

// Slow path, once lanes wait in more than one operation: a partner waiting in an operation that
// needs this lane is a certain deadlock. Returns the lanes waiting in this very operation.
static unsigned scan_partners(const Warp& w, int lane, int op, unsigned mask) {
  unsigned here = 0;
  for (int p = 0; p < 32; ++p) {
    const Lane& l = w.lane[p];
    if (!(w.pending >> p & 1u)) continue;
    if (l.op == op && l.mask == mask) here |= 1u << p;
    else if ((mask >> p & 1u) && (l.mask >> lane & 1u))
      fault_in_fiber(F_WARP, "warp divergence: lane %d calls %s (mask 0x%08x) while lane %d "
                     "waits for it in %s (mask 0x%08x)", lane, kOpNames[op], mask, p,
                     kOpNames[l.op], l.mask);
  }
  return here;
}

// Every lane of `mask` has arrived: compute all their results, release the others.
static void complete(Warp& w, int warp, int self, unsigned mask) {
  const int op = w.lane[self].op;
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && w.lane[l].val) ballot |= 1u << l;
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    Lane& x = w.lane[l];
    if (op >= OP_BALLOT) {
      x.res = op == OP_SYNC ? 0 : ballot;
    } else {  // a source outside the mask is undefined in CUDA: it reads as poison here
      const int src = shfl_source(op, l, x.arg, x.width);
      x.res = (mask >> src & 1u) ? w.lane[src].val : kPoison64;
    }
  }
  w.pending &= ~mask;
  if (!w.pending) w.mixed = false;
  race_warp_sync(warp);
  for (int l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && l != self) wake(warp * 32 + l);
}

EMU_API unsigned long long emu_warp_op(int op, unsigned mask, unsigned long long v, int arg,
                                          int width) {
  const int tid = g_cur->tid, lane = tid & 31;
  Warp& w = g_block.warps[tid / 32];
  check_warp_op(w, lane, op, mask, width);
  // fast path: every waiting lane is in this same operation (w.gop, w.gmask)
  const bool same = !w.pending || (!w.mixed && w.gop == op && w.gmask == mask);
  const unsigned here = (same ? w.pending : scan_partners(w, lane, op, mask)) | 1u << lane;
  if (!w.pending) w.gop = op, w.gmask = mask;
  w.mixed = !same;
  w.lane[lane] = Lane{op, mask, v, arg, width, 0};
  w.pending |= 1u << lane;
  if ((here & mask) == mask) {
    complete(w, tid / 32, lane, mask);
  } else {
    g_cur->state = WAIT_WARP;
    settle_active(tid / 32);
    yield_fiber();
  }
  return w.lane[lane].res;
}

// __activemask: the lanes that reach it together. A lane waits until every other live lane of
// its warp is blocked (here, in a warp operation, at a barrier) or has exited; the result is the
// set waiting here then. So `if (lane >= 16) return;` leaves the other 16, as on the device.
EMU_API unsigned emu_activemask(void) {
  const int tid = g_cur->tid, lane = tid & 31;
  Warp& w = g_block.warps[tid / 32];
  w.active |= 1u << lane;
  w.lane[lane].op = OP_ACTIVE;
  w.lane[lane].mask = w.present & ~w.exited;
  g_cur->state = WAIT_WARP;
  settle_active(tid / 32);
  yield_fiber();
  return (unsigned)w.lane[lane].res;
}

namespace emu {
void settle_active(int warp) {
  Warp& w = g_block.warps[warp];
  const unsigned live = w.present & ~w.exited;
  if (!w.active || (live & ~(w.active | w.pending | w.at_bar))) return;
  for (int l = 0; l < 32; ++l)
    if (w.active >> l & 1u) w.lane[l].res = w.active, wake(warp * 32 + l);
  w.active = 0;
}
}  // namespace emu

namespace emu {
void on_fiber_exit(Fiber* f) {
  const int lane = f->tid & 31;
  Warp& w = g_block.warps[f->tid / 32];
  w.exited |= 1u << lane;
  for (int p = 0; p < 32; ++p)
    if ((w.pending >> p & 1u) && (w.lane[p].mask >> lane & 1u))
      fault_in_fiber(F_WARP, "lane %d exited while lane %d waits for it in %s (mask 0x%08x)",
                     lane, p, kOpNames[w.lane[p].op], w.lane[p].mask);
  settle_active(f->tid / 32);
}
}  // namespace emu

EMU_API void emu_trap(const char* file, int line) {
  fault_in_fiber(F_TRAP, "__trap() at %s:%d", file, line);
}

// --- -fsanitize=bounds: GCC's calls, with libubsan's data layout (no libubsan is linked) --------
struct UbsanLocation { const char* file; unsigned line, column; };
struct UbsanType { unsigned short kind, info; char name[1]; };
struct UbsanOutOfBounds { UbsanLocation loc; const UbsanType* array; const UbsanType* index; };

// An integer index is passed inline when it fits a pointer: info = log2(bits) << 1 | signed.
static long long index_value(const UbsanType* t, uintptr_t v) {
  const unsigned bits = 1u << (t->info >> 1);
  if (t->kind != 0 || bits > 64) return (long long)v;
  if ((t->info & 1) && bits < 64) return (long long)(v << (64 - bits)) >> (64 - bits);
  return (long long)v;
}

EMU_API void __ubsan_handle_out_of_bounds(UbsanOutOfBounds* d, uintptr_t index) {
  const long long i = index_value(d->index, index);
  if (!g_cur) {  // not device code under a launch: nothing to return to
    fprintf(stderr, "%s:%u:%u: index %lld out of bounds for type %s\n", d->loc.file,
            d->loc.line, d->loc.column, i, d->array->name);
    abort();
  }
  fault_in_fiber(F_BOUNDS, "array index %lld out of bounds for type %s at %s:%u:%u", i,
                 d->array->name, d->loc.file, d->loc.line, d->loc.column);
}

EMU_API void __ubsan_handle_out_of_bounds_abort(UbsanOutOfBounds* d, uintptr_t index) {
  __ubsan_handle_out_of_bounds(d, index);
}

// -fsanitize=alignment: a load or store through a pointer its type's alignment does not divide
// (a float4 or uint4 read at an address not 16-byte aligned faults on a GPU: misaligned address).
struct UbsanTypeMismatch { UbsanLocation loc; const UbsanType* type; unsigned char log_alignment,
                           check_kind; };

EMU_API void __ubsan_handle_type_mismatch_v1(UbsanTypeMismatch* d, uintptr_t ptr) {
  if (!g_cur) {
    fprintf(stderr, "%s:%u:%u: misaligned address 0x%llx for type %s\n", d->loc.file, d->loc.line,
            d->loc.column, (unsigned long long)ptr, d->type->name);
    abort();
  }
  fault_in_fiber(F_MEMORY, "misaligned address 0x%llx for type %s, which needs %u-byte alignment, "
                 "at %s:%u:%u", (unsigned long long)ptr, d->type->name, 1u << d->log_alignment,
                 d->loc.file, d->loc.line, d->loc.column);
}

EMU_API void __ubsan_handle_type_mismatch_v1_abort(UbsanTypeMismatch* d, uintptr_t ptr) {
  __ubsan_handle_type_mismatch_v1(d, ptr);
}
