// A small persistent thread pool for the CPU kernels.
//
// One pool per process: threads are a process resource, and a single pool is
// what keeps the kernels from oversubscribing the cores. The thread calling
// parallel_for (MLX's CPU stream thread) takes part, so a pool of size T runs
// T - 1 workers. A second caller arriving while a job runs (another stream, or
// a kernel nested in a kernel) runs its job on its own thread instead of
// queueing behind the first or adding threads.
//
//   caller ──► publish job (gen, fn, n) ──► workers spin briefly, then sleep
//      │            next = gen<<32 | 0        │
//      ├─ claims tasks by CAS on `next` ◄─────┤ claim while next>>32 == gen
//      └─ waits until done == n               └─ done += 1 per task
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mlx_infer::cpu {

class ThreadPool {
 public:
  /// `threads`: total threads a job runs on, the caller included (>= 1).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  /// Runs fn(t) for every t in [0, n_tasks), in any order, across the pool;
  /// returns when all have finished. fn must not throw.
  void parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn);

 private:
  void worker_loop();
  bool run_tasks(uint32_t gen);

  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the caller of the running job

  // The published job. `next` packs (generation << 32) | next task index, so a
  // worker that read a stale job can never claim a task of a newer one.
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0};
  // Atomic only because a stale worker may read them while the next job is
  // published; it then fails the generation check before using them.
  std::atomic<const std::function<void(int64_t)>*> fn_{nullptr};
  std::atomic<int64_t> n_tasks_{0};
  std::atomic<uint32_t> gen_{0};

  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

/// The process-wide pool, created on first use with cpu_threads() threads.
ThreadPool& pool();

/// Physical cores this process may run on, or MLX_INFER_CPU_THREADS when set.
int configured_threads();

}  // namespace mlx_infer::cpu
