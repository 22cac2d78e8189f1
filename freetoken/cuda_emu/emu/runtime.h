// runtime.h -- what the runtime's parts share: runtime.cpp (launch, fibers, scheduler, signals),
// sync.cpp (barriers, warp operations, __trap, the bounds-sanitizer hooks), alloc.cpp (device
// allocations, poison) and race.cpp (race mode's shared-memory shadow). Built once into a shared runtime .so that every kernel .so links against
// at load time (device_code.py loads it RTLD_GLOBAL), so all modules share one launch lock.
#pragma once
#include <stddef.h>
#include <stdint.h>

// The runtime is built with -fvisibility=hidden: only these extern "C" names are its interface.
#define EMU_API extern "C" __attribute__((visibility("default")))

namespace emu {

constexpr int kMaxThreads = 1024;
constexpr size_t kMaxDynSmem = 227 * 1024;  // the opt-in maximum of sm_90
constexpr uint64_t kPoison64 = 0xFFC7FFC7FFC7FFC7ull;  // NaN as bf16 and as f32

enum State { RUNNABLE, WAIT_BAR, WAIT_WARP, EXITED };
// EmuFaultInfo.kind; device_code.py only distinguishes memory faults (they carry an address)
enum FaultKind { F_NONE, F_MEMORY, F_BOUNDS, F_BARRIER, F_WARP, F_TRAP, F_CONFIG, F_ARITH, F_RACE };

struct Dim3 { unsigned x, y, z; };

// Mirrored by ctypes structures in device_code.py: change both together.
struct LaunchArgs {
  void (*entry)(void**);   // the generated trampoline: unpacks params and calls the kernel
  void** params;           // one pointer per kernel parameter, to its value (cuLaunchKernel style)
  unsigned grid[3], block[3];
  unsigned long long shared_mem;
  char* static_lo;         // the module's static __shared__ section
  char* static_hi;
  const char* name;
};
struct FaultInfo {
  unsigned long long address;
  int has_address;
  int kind;
  char message[2048];
};

struct Fiber {
  void* sp;                // saved stack pointer while switched out
  void* uc;                // ucontext_t* on hosts without the x86-64 switch
  Dim3 idx;
  int tid;                 // linear thread id: warp tid / 32, lane tid % 32
  int state;
};

struct Lane { int op; unsigned mask; uint64_t val; int arg, width; uint64_t res; };
// pending: lanes waiting in a shuffle/vote/syncwarp; active: waiting in __activemask; at_bar:
// waiting at __syncthreads. gop/gmask: the operation of the pending lanes unless mixed.
struct Warp {
  unsigned present, exited, pending, active, at_bar, gmask;
  int gop;
  bool mixed;
  Lane lane[32];
};

struct Block {
  int n, exited;
  int bar_waiting, bar_count, bar_result, bar_line;
  const char* bar_file;
  int queue[kMaxThreads], qhead, qlen;  // runnable fibers, in the order they become so
  Warp warps[kMaxThreads / 32];
};

extern Block g_block;
extern Fiber* g_cur;                // the running fiber; null while the scheduler runs
extern const LaunchArgs* g_args;
extern FaultInfo* g_fault;

Fiber* fiber(int tid);
void wake(int tid);                 // state RUNNABLE and into the run queue
void yield_fiber();                 // the running fiber back to the scheduler (state already set)
[[noreturn]] void fault_in_fiber(int kind, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));
void set_fault(int kind, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
bool resolve_stall();               // sync.cpp: release the barrier, or report why none can run
void on_fiber_exit(Fiber* f);       // sync.cpp: warp partners still waiting for it fault
void settle_active(int warp);       // sync.cpp: complete __activemask once the warp is blocked
void fill_poison(void* p, size_t n);
bool poisoned(const void* p, size_t n);
void describe_allocation(uintptr_t addr, char* buf, size_t n);
// race.cpp: the orderings race mode tracks (its hooks are no-ops for uninstrumented kernels)
void race_block_start(char* dyn, size_t dyn_len);
void race_barrier();                // a __syncthreads released the block
void race_warp_sync(int warp);      // a warp operation completed in `warp`

}  // namespace emu

extern "C" __attribute__((visibility("default"))) emu::Dim3 emu_block_dim;

namespace emu {
// runtime.cpp, for launch.cpp: the launch proper (both run under launch.cpp's lock)
int prepare_launch();               // checks g_args and sets up the built-ins; a FaultKind
int run_grid();                     // every block; a FaultKind
void end_launch();
void describe_address(uintptr_t addr, char* buf, size_t n);
}  // namespace emu
