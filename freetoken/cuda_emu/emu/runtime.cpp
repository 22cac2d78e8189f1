// runtime.cpp -- one kernel launch: the grid's blocks one after another, each block's threads as
// fibers (one per CUDA thread, stacks reused from block to block) under a run-queue scheduler, and
// SIGSEGV/SIGBUS/SIGFPE/SIGILL caught while the launch runs and turned into a fault report.
// Fibers switch only inside runtime calls (barriers, warp operations, exit), so between those a
// thread runs alone: that is what makes plain loads and stores behave like shared memory.
#include "runtime.h"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define EMU_VAR __attribute__((visibility("default")))
extern "C" {  // definitions (braces): what cuda_emu.h's threadIdx, blockIdx, ... read
EMU_VAR emu::Dim3* emu_thread_idx;
EMU_VAR emu::Dim3 emu_block_idx, emu_block_dim, emu_grid_dim;
EMU_VAR void* emu_dyn_smem;
}

namespace emu {

Block g_block;
Fiber* g_cur;
const LaunchArgs* g_args;
FaultInfo* g_fault;

constexpr size_t kStack = 256 * 1024;       // per fiber; the kernels keep small frames
static Fiber g_fibers[kMaxThreads];
static char* g_stacks;                      // kMaxThreads slots: guard page, then the stack
static size_t g_page, g_slot;
static char* g_dyn_guard;                   // the page after the dynamic shared buffer
static char* g_dyn_lo;                      // the first byte of the dynamic shared mapping
constexpr size_t kSmemCanary = 256;         // bytes before the dynamic buffer checked per block

// The poisoned bytes before the dynamic buffer whose change reveals a write at a negative index.
static char* dyn_canary() {
  char* at = static_cast<char*>(emu_dyn_smem) - kSmemCanary;
  return at < g_dyn_lo ? g_dyn_lo : at;
}

Fiber* fiber(int tid) { return &g_fibers[tid]; }

// --- context switch: callee-saved registers on the fiber's own stack (no syscall, unlike
// glibc swapcontext, which saves the signal mask on every switch) --------------------------------
static void fiber_main(Fiber* f);
static Fiber g_sched;                       // the scheduler: the launching thread's own stack
#if defined(__x86_64__)
extern "C" void emu_ctx_switch(void** save_sp, void* to_sp) __attribute__((visibility("hidden")));
extern "C" char emu_ctx_start[] __attribute__((visibility("hidden")));
asm(".text\n.globl emu_ctx_switch\n.hidden emu_ctx_switch\n.type emu_ctx_switch,@function\n"
    "emu_ctx_switch:\n pushq %rbp\n pushq %rbx\n pushq %r12\n pushq %r13\n pushq %r14\n pushq %r15\n"
    " movq %rsp, (%rdi)\n movq %rsi, %rsp\n"
    " popq %r15\n popq %r14\n popq %r13\n popq %r12\n popq %rbx\n popq %rbp\n ret\n"
    ".globl emu_ctx_start\n.hidden emu_ctx_start\n"
    "emu_ctx_start:\n movq %r12, %rdi\n callq *%r13\n ud2\n");

// A fresh frame for emu_ctx_switch to pop: r15 r14 r13=fiber_main r12=f rbx rbp, then the return
// into emu_ctx_start, which calls fiber_main(f) with the stack 16-byte aligned.
static void prepare(Fiber* f, char* top) {
  void** s = reinterpret_cast<void**>(top - 72);
  void* frame[7] = {nullptr, nullptr, reinterpret_cast<void*>(&fiber_main), f, nullptr, nullptr,
                    emu_ctx_start};
  memcpy(s, frame, sizeof frame);
  f->sp = s;
}
static void switch_to(Fiber* from, Fiber* to) { emu_ctx_switch(&from->sp, to->sp); }
#else
static ucontext_t g_ucs[kMaxThreads + 1];   // the last one is the scheduler's
static void uc_main() { fiber_main(g_cur); }
static void prepare(Fiber* f, char* top) {
  ucontext_t* uc = &g_ucs[f->tid];
  getcontext(uc);
  uc->uc_stack.ss_sp = top - (kStack - g_page);
  uc->uc_stack.ss_size = kStack - g_page;
  uc->uc_link = nullptr;
  makecontext(uc, uc_main, 0);
  f->uc = uc;
  g_sched.uc = &g_ucs[kMaxThreads];
}
static void switch_to(Fiber* from, Fiber* to) {
  swapcontext(static_cast<ucontext_t*>(from->uc), static_cast<ucontext_t*>(to->uc));
}
#endif

// --- schedule fuzz (FREETOKEN_CUDA_EMULATE_FUZZ=seed): a random runnable fiber runs next, and
// the blocks of a grid run in a random order, so a kernel whose answer depends on the order the
// device happens to pick shows it (and race mode sees other interleavings) ----------------------
static uint64_t g_fuzz;  // xorshift64 state; 0: off (threads in wake order, blocks in order)

static uint64_t fuzz_next() {
  g_fuzz ^= g_fuzz << 13, g_fuzz ^= g_fuzz >> 7, g_fuzz ^= g_fuzz << 17;
  return g_fuzz;
}

static Fiber* pop_runnable() {
  Block& b = g_block;
  if (g_fuzz && b.qlen > 1) {  // swap a random runnable one to the head
    const int k = (b.qhead + (int)(fuzz_next() % b.qlen)) % kMaxThreads;
    const int t = b.queue[k];
    b.queue[k] = b.queue[b.qhead], b.queue[b.qhead] = t;
  }
  Fiber* f = &g_fibers[b.queue[b.qhead]];
  b.qhead = (b.qhead + 1) % kMaxThreads, b.qlen--;
  return f;
}

// The running fiber blocks (its state already says why): straight on to the next runnable fiber,
// one switch rather than two through the scheduler, or to the scheduler when none is left or a
// fault ends the block.
void yield_fiber() {
  Fiber* self = g_cur;
  Fiber* next = g_block.qlen > 0 && !g_fault->kind ? pop_runnable() : &g_sched;
  if (next == self) return;
  g_cur = next == &g_sched ? nullptr : next;
  if (g_cur) emu_thread_idx = &g_cur->idx;
  switch_to(self, next);
}

static void fiber_main(Fiber* f) {
  g_args->entry(g_args->params);
  f->state = EXITED;
  g_block.exited++;
  on_fiber_exit(f);
  yield_fiber();  // never resumed: the next block prepares a fresh frame
  __builtin_unreachable();
}

// --- fault reports ------------------------------------------------------------------------------
static int where(char* buf, size_t n) {
  const Dim3 b = emu_block_idx;
  if (!g_cur) return snprintf(buf, n, "block (%u,%u,%u)", b.x, b.y, b.z);
  const Dim3 t = g_cur->idx;
  return snprintf(buf, n, "block (%u,%u,%u), thread (%u,%u,%u)", b.x, b.y, b.z, t.x, t.y, t.z);
}

static bool g_running;  // blocks are running: fault reports name the block (and thread)

static void vset_fault(int kind, const char* fmt, va_list ap) {
  if (g_fault->kind) return;  // the first fault is the one to report
  char* m = g_fault->message;
  const size_t n = sizeof g_fault->message;
  int k = snprintf(m, n, "kernel %s: ", g_args->name);
  k += vsnprintf(m + k, n - k, fmt, ap);
  if (g_running && k < (int)n - 3) {
    k += snprintf(m + k, n - k, " (");
    if (k < (int)n - 2) k += where(m + k, n - k);
    if (k < (int)n - 1) snprintf(m + k, n - k, ")");
  }
  g_fault->kind = kind;
}

void set_fault(int kind, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vset_fault(kind, fmt, ap);
  va_end(ap);
}

void fault_in_fiber(int kind, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vset_fault(kind, fmt, ap);
  va_end(ap);
  g_cur->state = EXITED;
  yield_fiber();  // the scheduler sees the fault and abandons the block
  __builtin_unreachable();
}

// --- the scheduler ------------------------------------------------------------------------------
void wake(int tid) {
  Block& b = g_block;
  g_fibers[tid].state = RUNNABLE;
  b.queue[(b.qhead + b.qlen++) % kMaxThreads] = tid;
}

static void start_block() {
  Block& b = g_block;
  const Dim3 d = emu_block_dim;
  fill_poison(g_args->static_lo, g_args->static_hi - g_args->static_lo);
  fill_poison(dyn_canary(), g_dyn_guard - dyn_canary());
  race_block_start(static_cast<char*>(emu_dyn_smem), g_args->shared_mem);
  b.exited = b.bar_waiting = b.bar_count = b.qhead = b.qlen = 0;
  for (int w = 0; w < (b.n + 31) / 32; ++w) {
    const int lanes = b.n - 32 * w < 32 ? b.n - 32 * w : 32;
    b.warps[w].present = lanes == 32 ? ~0u : (1u << lanes) - 1;
    b.warps[w].exited = b.warps[w].pending = b.warps[w].active = b.warps[w].at_bar = 0;
    b.warps[w].mixed = false;
  }
  for (int t = 0; t < b.n; ++t) {
    Fiber* f = &g_fibers[t];
    f->tid = t;
    f->idx = {t % d.x, t / d.x % d.y, t / (d.x * d.y)};
    prepare(f, g_stacks + t * g_slot + g_slot);
    wake(t);
  }
}

// Runs the block to completion; false when it faulted (g_fault says how).
static bool run_block() {
  Block& b = g_block;
  start_block();
  for (;;) {
    while (b.qlen > 0) {  // fibers pass control among themselves until none can run
      g_cur = pop_runnable();
      emu_thread_idx = &g_cur->idx;
      switch_to(&g_sched, g_cur);
      g_cur = nullptr;
      if (g_fault->kind) return false;
    }
    if (b.exited == b.n) break;
    if (!resolve_stall()) return false;
  }
  const size_t used = g_args->shared_mem, slack = g_dyn_guard - (char*)emu_dyn_smem - used;
  if (!poisoned((char*)emu_dyn_smem + used, slack))
    set_fault(F_MEMORY, "wrote past the end of its %llu-byte dynamic shared memory",
              (unsigned long long)used);
  char* canary = dyn_canary();
  for (char* c = canary; !g_fault->kind && c < (char*)emu_dyn_smem; ++c)
    if (!poisoned(c, 1))   // the first changed byte: the most negative index written
      set_fault(F_MEMORY, "wrote %lld bytes before the start of its %llu-byte dynamic shared "
                "memory (a negative index)", (long long)((char*)emu_dyn_smem - c),
                (unsigned long long)used);
  return !g_fault->kind;
}

static uint64_t gcd(uint64_t a, uint64_t b) { return b ? gcd(b, a % b) : a; }

// Blocks in order, or under fuzz i -> (start + i * stride) mod n with stride coprime to n: every
// block once, in an order that differs from launch to launch without a table of n entries.
int run_grid() {
  const unsigned* g = g_args->grid;
  const uint64_t n = (uint64_t)g[0] * g[1] * g[2];
  uint64_t start = 0, stride = 1;
  if (g_fuzz && n > 1) {
    start = fuzz_next() % n;
    do stride = 1 + fuzz_next() % (n - 1); while (gcd(stride, n) != 1);
  }
  g_running = true;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t b = (start + i * stride) % n;
    emu_block_idx = {(unsigned)(b % g[0]), (unsigned)(b / g[0] % g[1]), (unsigned)(b / g[0] / g[1])};
    if (!run_block()) return g_fault->kind;
  }
  return F_NONE;
}

}  // namespace emu

EMU_API void emu_set_fuzz(unsigned long long seed) {
  emu::g_fuzz = seed ? (seed * 0x9E3779B97F4A7C15ull) | 1 : 0;
}

namespace emu {

void end_launch() {
  g_running = false;
  g_cur = nullptr;
  emu_thread_idx = nullptr;
}

// --- pools, mapped once: fiber stacks (each above a guard page) and the dynamic shared buffer --
static bool map_pools() {
  if (g_stacks) return true;
  g_page = sysconf(_SC_PAGESIZE);
  g_slot = kStack + g_page;
  const int prot = PROT_READ | PROT_WRITE, flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  void* s = mmap(nullptr, kMaxThreads * g_slot, prot, flags, -1, 0);
  const size_t dyn = (kMaxDynSmem + g_page - 1) / g_page * g_page;
  void* d = mmap(nullptr, dyn + 2 * g_page, PROT_NONE, flags, -1, 0);
  if (s == MAP_FAILED || d == MAP_FAILED || mprotect((char*)d + g_page, dyn, prot)) return false;
  for (int t = 0; t < kMaxThreads; ++t) mprotect((char*)s + t * g_slot, g_page, PROT_NONE);
  g_dyn_guard = (char*)d + g_page + dyn;
  g_dyn_lo = (char*)d + g_page;
  g_stacks = (char*)s;
  return true;
}

// Checks the launch shape (device_code.py checks it first, with the opt-in rules) and sets up
// the built-in variables and the dynamic buffer: its end 16-byte rounded against the guard page.
int prepare_launch() {
  const LaunchArgs* a = g_args;
  if (!map_pools()) {
    set_fault(F_CONFIG, "could not map the fiber stacks and shared memory");
    return F_CONFIG;
  }
  const unsigned long long n = (unsigned long long)a->block[0] * a->block[1] * a->block[2];
  if (n == 0 || n > kMaxThreads || !a->grid[0] || !a->grid[1] || !a->grid[2] ||
      a->shared_mem > kMaxDynSmem) {
    set_fault(F_CONFIG, "invalid launch: grid (%u,%u,%u), block (%u,%u,%u), %llu bytes of "
              "dynamic shared memory", a->grid[0], a->grid[1], a->grid[2], a->block[0],
              a->block[1], a->block[2], a->shared_mem);
    return F_CONFIG;
  }
  emu_grid_dim = {a->grid[0], a->grid[1], a->grid[2]};
  emu_block_dim = {a->block[0], a->block[1], a->block[2]};
  g_block.n = (int)n;
  emu_dyn_smem = g_dyn_guard - ((a->shared_mem + 15) & ~15ull);
  return F_NONE;
}

// What a faulting address is, when the runtime owns it: a stack guard or the shared buffer's.
void describe_address(uintptr_t addr, char* buf, size_t n) {
  const uintptr_t dyn = (uintptr_t)emu_dyn_smem, guard = (uintptr_t)g_dyn_guard;
  const uintptr_t stacks = (uintptr_t)g_stacks, end = stacks + kMaxThreads * g_slot;
  if (addr >= dyn && addr < guard + g_page && g_args) {
    snprintf(buf, n, "dynamic shared memory out of bounds: byte %llu of a %llu-byte buffer",
             (unsigned long long)(addr - dyn), g_args->shared_mem);
  } else if (addr >= stacks && addr < end && (addr - stacks) % g_slot < g_page) {
    snprintf(buf, n, "stack overflow of the fiber of thread %d (stacks are %zu KiB)",
             (int)((addr - stacks) / g_slot), kStack / 1024);
  } else if (addr == 0) {
    snprintf(buf, n, "a null pointer, or a misaligned vector access or non-canonical address "
             "(reported by the CPU as address 0)");
  } else {
    describe_allocation(addr, buf, n);
  }
}
}  // namespace emu
