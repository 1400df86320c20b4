#include "threadpool.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <utility>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace mlx_infer::cpu {

namespace {

// How long an idle worker keeps polling before it sleeps: long enough to catch
// the next job of a prefill (GEMMs a few microseconds apart) without a futex
// wake, short enough not to steal a small machine's core from the thread that
// builds the next graph while MLX evaluates this one.
constexpr auto kSpin = std::chrono::microseconds(20);
constexpr uint64_t kIndexMask = 0xffffffffull;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this] { worker_loop(); });
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  {
    std::lock_guard<std::mutex> lk(sleep_mu_);
    sleep_cv_.notify_all();
  }
  for (auto& t : workers_) {
    t.join();
  }
}

bool ThreadPool::run_tasks(uint32_t gen) {
  const auto* fn = fn_.load(std::memory_order_relaxed);
  const int64_t n = n_tasks_.load(std::memory_order_relaxed);
  bool ran = false;
  uint64_t v = next_.load(std::memory_order_acquire);
  for (;;) {
    if ((v >> 32) != gen || static_cast<int64_t>(v & kIndexMask) >= n) {
      return ran;
    }
    if (next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) {
      (*fn)(static_cast<int64_t>(v & kIndexMask));
      done_.fetch_add(1, std::memory_order_release);
      ran = true;
      v = next_.load(std::memory_order_acquire);
    }
  }
}

void ThreadPool::worker_loop() {
  uint32_t seen = gen_.load();
  for (;;) {
    uint32_t g = gen_.load(std::memory_order_acquire);
    if (g == seen) {
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0;; ++i) {
        g = gen_.load(std::memory_order_acquire);
        if (g != seen || stop_.load(std::memory_order_relaxed)) {
          break;
        }
        cpu_relax();
        if ((i & 255) == 255 && std::chrono::steady_clock::now() - t0 > kSpin) {
          break;
        }
      }
    }
    if (g == seen) {
      sleepers_.fetch_add(1);
      std::unique_lock<std::mutex> lk(sleep_mu_);
      sleep_cv_.wait(lk, [&] { return gen_.load() != seen || stop_.load(); });
      sleepers_.fetch_sub(1);
      g = gen_.load();
    }
    if (stop_.load()) {
      return;
    }
    seen = g;
    run_tasks(g);
  }
}

void ThreadPool::parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn) {
  if (n_tasks <= 0) {
    return;
  }
  std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
  if (n_tasks == 1 || workers_.empty() || !busy.owns_lock() ||
      n_tasks >= static_cast<int64_t>(kIndexMask)) {
    for (int64_t t = 0; t < n_tasks; ++t) {
      fn(t);
    }
    return;
  }
  const uint32_t g = gen_.load() + 1;
  fn_.store(&fn, std::memory_order_relaxed);
  n_tasks_.store(n_tasks, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  next_.store(static_cast<uint64_t>(g) << 32, std::memory_order_release);
  gen_.store(g);  // seq_cst: ordered against the sleepers_ read below
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lk(sleep_mu_);
    sleep_cv_.notify_all();
  }
  run_tasks(g);
  for (int i = 0; done_.load(std::memory_order_acquire) < n_tasks; ++i) {
    if (i < (1 << 16)) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
  // Close the job so a worker still holding this generation can claim nothing.
  next_.store((static_cast<uint64_t>(g) << 32) | kIndexMask, std::memory_order_release);
}

int configured_threads() {
  if (const char* env = std::getenv("MLX_INFER_CPU_THREADS")) {
    try {
      int n = std::stoi(env);
      if (n >= 1) {
        return n;
      }
    } catch (...) {
    }
  }
  int logical = static_cast<int>(std::thread::hardware_concurrency());
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    std::set<std::pair<std::string, std::string>> cores;
    int allowed = 0;
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (!CPU_ISSET(c, &set)) {
        continue;
      }
      ++allowed;
      std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
      std::ifstream core(base + "core_id"), pkg(base + "physical_package_id");
      std::string core_id, pkg_id;
      if (!(core >> core_id) || !(pkg >> pkg_id)) {
        cores.clear();
        break;
      }
      cores.emplace(pkg_id, core_id);
    }
    if (!cores.empty()) {
      return static_cast<int>(cores.size());
    }
    if (allowed > 0) {
      return allowed;
    }
  }
#endif
  return logical > 0 ? logical : 1;
}

ThreadPool& pool() {
  // Leaked on purpose: joining threads from a static destructor at interpreter
  // exit can deadlock against MLX's own teardown.
  static ThreadPool* p = new ThreadPool(configured_threads());
  return *p;
}

}  // namespace mlx_infer::cpu
