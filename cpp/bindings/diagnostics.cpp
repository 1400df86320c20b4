// Diagnostics for a device run without a debugger (the H200 image has no gdb): on a fatal signal, print the
// native stack (glibc's backtrace, symbol names from the dynamic symbol tables) to stderr, then hand the signal
// to the handler that was there before (Python's faulthandler prints the Python stack) or the default one.
#include <nanobind/nanobind.h>

#include <csignal>
#include <cstring>

#if defined(__GLIBC__)
#include <execinfo.h>
#include <unistd.h>
#endif

namespace nb = nanobind;

namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction previous[sizeof(kSignals) / sizeof(kSignals[0])];

void on_fatal(int sig) {
#if defined(__GLIBC__)
  const char head[] = "\n[mlx_infer] fatal signal; native stack (most recent call first):\n";
  (void)!write(STDERR_FILENO, head, sizeof(head) - 1);
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);  // async-signal-safe: no malloc
#endif
  for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i) {
    if (kSignals[i] == sig) {
      sigaction(sig, &previous[i], nullptr);
      break;
    }
  }
  raise(sig);
}

bool install_crash_backtrace() {
#if defined(__GLIBC__)
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now: loading it inside the handler is not signal-safe
  for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_fatal;
    sigemptyset(&sa.sa_mask);
    sigaction(kSignals[i], &sa, &previous[i]);
  }
  return true;
#else
  return false;
#endif
}

}  // namespace

void bind_diagnostics(nb::module_& m) {
  m.def("install_crash_backtrace", &install_crash_backtrace,
        "On SIGSEGV/SIGBUS/SIGFPE/SIGILL/SIGABRT print the native stack to stderr, then pass the signal to the "
        "handler installed before (call after faulthandler.enable() to get the Python stack too). Returns False "
        "where glibc's backtrace is not available.");
}
