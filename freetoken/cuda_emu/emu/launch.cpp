// launch.cpp -- emu_launch, the entry point device_code.py calls through ctypes: one launch at a
// time (static __shared__ storage and the fiber pool are shared), and while it runs, faults of the
// launching thread (SIGSEGV and SIGBUS on guard pages, SIGFPE, SIGILL) are caught on an alternate
// signal stack and siglongjmp back here. Other threads' faults, and every fault outside a launch,
// go to whatever handler was installed before.
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "runtime.h"

namespace emu {

static pthread_mutex_t g_mutex = PTHREAD_MUTEX_INITIALIZER;

// CuPy compiles every kernel with -ftz=true: f32 subnormal inputs and results are zero on the
// device. The kernels run on this thread, so its MXCSR gets DAZ and FTZ for the launch and its
// own value back after (numpy on this thread keeps its subnormals). x86-64 hosts only.
#if defined(__x86_64__)
static unsigned flush_subnormals() {
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
  return saved;
}
static void restore_subnormals(unsigned saved) { _mm_setcsr(saved); }
#else
static unsigned flush_subnormals() { return 0; }
static void restore_subnormals(unsigned) {}
#endif
static const int kSignals[4] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
static struct sigaction g_old_act[4];
static stack_t g_old_stack;
constexpr size_t kAltStack = 256 * 1024;  // room for the handler and siglongjmp
static void* g_alt_stack;
static sigjmp_buf g_jmp;
static volatile sig_atomic_t g_in_launch;
static pthread_t g_launch_thread;
static volatile int g_sig;
static void* volatile g_sig_addr;

static void forward(int sig, siginfo_t* si, void* uc) {
  for (int i = 0; i < 4; ++i) {
    if (kSignals[i] != sig) continue;
    const struct sigaction& old = g_old_act[i];
    if (old.sa_flags & SA_SIGINFO) return old.sa_sigaction(sig, si, uc);
    if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN) return old.sa_handler(sig);
  }
  signal(sig, SIG_DFL);  // returning re-runs the faulting instruction, now with the default action
}

static void on_signal(int sig, siginfo_t* si, void* uc) {
  if (!g_in_launch || !pthread_equal(pthread_self(), g_launch_thread)) return forward(sig, si, uc);
  g_sig = sig;
  g_sig_addr = si->si_addr;
  siglongjmp(g_jmp, 1);
}

static bool install_handlers() {
  if (!g_alt_stack) {
    void* s = mmap(nullptr, kAltStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (s == MAP_FAILED) return false;
    g_alt_stack = s;
  }
  stack_t ss;
  ss.ss_sp = g_alt_stack;
  ss.ss_size = kAltStack;
  ss.ss_flags = 0;
  if (sigaltstack(&ss, &g_old_stack)) return false;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < 4; ++i) sigaction(kSignals[i], &sa, &g_old_act[i]);
  g_launch_thread = pthread_self();
  g_in_launch = 1;
  return true;
}

static void remove_handlers() {
  g_in_launch = 0;
  for (int i = 0; i < 4; ++i) sigaction(kSignals[i], &g_old_act[i], nullptr);
  sigaltstack(&g_old_stack, nullptr);
}

static int signal_fault() {
  if (g_sig == SIGFPE) {
    set_fault(F_ARITH, "arithmetic exception (SIGFPE: integer division by zero or overflow)");
  } else if (g_sig == SIGILL) {
    set_fault(F_TRAP, "illegal instruction (SIGILL)");
  } else {
    const uintptr_t addr = (uintptr_t)g_sig_addr;
    char what[1024];
    describe_address(addr, what, sizeof what);
    set_fault(F_MEMORY, "invalid memory access at 0x%llx (%s): %s", (unsigned long long)addr,
              g_sig == SIGBUS ? "SIGBUS" : "SIGSEGV", what);
    g_fault->address = addr;
    g_fault->has_address = 1;
  }
  return g_fault->kind;
}

}  // namespace emu

// Runs the whole grid; 0, or a FaultKind with `out` filled in. The runtime stays usable after a
// fault: the next block or launch prepares fresh fiber frames and resets every queue and count.
EMU_API int emu_launch(const emu::LaunchArgs* a, emu::FaultInfo* out) {
  using namespace emu;
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&g_mutex);
  g_args = a;
  g_fault = out;
  int rc = prepare_launch();
  if (rc == F_NONE && !install_handlers()) {
    set_fault(F_CONFIG, "could not install the fault handlers");
    rc = F_CONFIG;
  } else if (rc == F_NONE) {
    const unsigned csr = flush_subnormals();
    if (sigsetjmp(g_jmp, 1) == 0) rc = run_grid();
    else rc = signal_fault();
    restore_subnormals(csr);
    remove_handlers();
  }
  end_launch();
  g_args = nullptr;
  g_fault = nullptr;
  pthread_mutex_unlock(&g_mutex);
  return rc;
}
