// l2_prefetch (mlx_infer/matmul.h): ask the L2 for a later product's weight while other kernels run.
//
// A one-row product of a mid-size weight streams it from HBM at ~2.1-2.4 TB/s of an H200's 4.8 (a ~7-15 us
// kernel cannot hide its ramp and tail: benchmarks/RESULTS.md, sessions 15 and 25), and in a 1-stream decode
// step the kernels between the q|k|v product and the o product (RoPE, the K/V writes, the paged attention: ~10-20
// us on a few blocks) leave HBM nearly idle. This kernel issues ``prefetch.global.L2`` for every 128-byte line of
// ``w`` (fire and forget: it does not wait for the data) and copies ``x`` through, so it sits in the graph
// before the kernels that consume ``x``; by the time the product of ``w`` runs, its lines are in the L2 (an
// H100's 50 MB, an H200's 60 MB hold llama-8B's 32 MiB o weight). benchmarks/gpu_l2_prefetch_probe.py measures
// the mechanism; the decode graphs take it behind MLX_INFER_L2_PREFETCH_O=1.
#include "mlx_infer/backend.h"
#include "mlx_infer/matmul.h"
#include "mlx_infer/text.h"

#include <mlx/fast.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>

namespace mlx_infer {

namespace {

// Template constants: kLines (128-byte lines of w), kN (elements of x). x copied to out; w only prefetched.
constexpr const char* kSource = R"(
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long threads = (long long)gridDim.x * blockDim.x;
  const char* base = reinterpret_cast<const char*>(w);
  for (long long i = tid; i < kLines; i += threads) {
    asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(base + i * 128));
  }
  for (long long i = tid; i < kN; i += threads) out[i] = x[i];
)";

const ReusedKernel& kernel() {
  static std::once_flag once;
  static ReusedKernel fn;
  std::call_once(once, [] {
    fn = ReusedKernel(mx::fast::cuda_kernel("mlxi_l2_prefetch", {"x", "w"}, {"out"}, kSource, ""));
  });
  return fn;
}

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 256;  // enough issuing threads: a few prefetches each for a 32-48 MiB weight

}  // namespace

bool l2_prefetch_o_enabled() {
  return env_int("MLX_INFER_L2_PREFETCH_O", 0, 1, 0, "1: prefetch each layer's o weight into the L2") == 1;
}

bool l2_prefetch_applies(const mx::array& x, const mx::array& w) {
  return cuda_backend() && mx::default_device() == mx::Device::gpu && x.size() > 0 && w.nbytes() >= 128 &&
         w.nbytes() / 128 <= static_cast<size_t>(1) << 31 && x.size() <= static_cast<size_t>(1) << 31;
}

mx::array l2_prefetch(const mx::array& x, const mx::array& w) {
  if (!l2_prefetch_applies(x, w)) {
    throw std::invalid_argument("[l2_prefetch] runs on MLX's CUDA backend (default device the GPU) with a non-empty "
                                "x and a weight of at least 128 bytes; got x " + shape_text(x.shape()) + " and w " +
                                shape_text(w.shape()) + ".");
  }
  const long lines = static_cast<long>(w.nbytes() / 128);
  const int blocks = static_cast<int>(std::min<long>(kMaxBlocks, (lines + kThreads - 1) / kThreads));
  return kernel()({x, w}, {x.shape()}, {x.dtype()}, {blocks * kThreads, 1, 1}, {kThreads, 1, 1},
                  {{"kLines", static_cast<int>(lines)}, {"kN", static_cast<int>(x.size())}}, std::nullopt, false,
                  {})[0];  // x's shape and values
}

}  // namespace mlx_infer
