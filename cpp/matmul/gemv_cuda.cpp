// skinny_linear (mlx_infer/matmul.h): `x @ w.T (+ bias)` for a few rows on CUDA, our GEMV kernel.
//
// A decode step with few rows is a chain of matrix-vector products that only stream their weights, and MLX's
// CUDA GEMV (mlx/backend/cuda/gemms/gemv.cu: one warp per row, one 16-byte load per lane in flight; M = 1 only,
// cuBLAS above) reads them at 1-3 TB/s of the H200's 4.8 (benchmarks/RESULTS.md, "matmul by matmul"): a
// 4096 x 4096 product finishes in ~28 us where 7 would stream it. Here each warp owns kR rows of w and its
// lanes walk K in 16-byte chunks, kU chunks per lane loaded at once before any is used (kU x kR loads of
// 16 bytes in flight per lane), the kM rows of x read alongside from L1/L2 (they are small); float32
// accumulation, one rounding to the output dtype, a bias added in float32 before it. Compiled at run time by
// NVRTC through mx::fast::cuda_kernel (it runs inside mx::compile'd graphs like any other op), one module
// per (dtype, kM, tiling, bias): K and N are read from the shapes.
#include "mlx_infer/backend.h"
#include "mlx_infer/matmul.h"
#include "mlx_infer/text.h"
#include "gemv_common.h"

#include <mlx/fast.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace mlx_infer {

namespace {

// Which dense CUDA products of the decode graphs run here (gemv_takes): 2 to kDefaultMaxRows rows of x
// (products of the leading axes) and a weight of at most kDefaultMaxWeightMiB, where MLX_INFER_GEMV_ROWS and
// MLX_INFER_GEMV_MAX_MIB are unset. Why (benchmarks/RESULTS.md, "Session 21"):
// - the host: from 2 rows MLX's CUDA product is cuBLASLt, whose descriptors, heuristic and graph capture
//   cost ~16-20 us of host time per product (benchmarks/submit_cost.py, H100: 17.8-20.2 us at 8-32 rows)
//   against ~12 us for this kernel (build + submit), and a few-row step is host-bound: llama-1B at 8 streams
//   took 3.92 ms a step through MLX's products and 2.84 ms with this kernel for every product (H100,
//   host_step.py --ab, same process); one row stays on MLX's own GEMV (4.7 us to submit, as fast: same A/B,
//   1 stream 1.78 vs 1.87 ms);
// - the device: at 8 rows this kernel is faster than cuBLAS on weights up to 32 MiB (H200, session 15's
//   gpu_gemv_probe.py: 1.16-1.98x on llama's q/o/kv/gate/down shapes) and slower on the large ones (8B
//   gate/down 0.70-0.72x at 112 MiB, the LM heads 0.50-0.63x), which is why every product through it lost
//   on llama-8B (8 streams 10.13 against 7.15 ms a step, H100; session 15's served A/B at 1-32 rows) while
//   llama-1B, host-bound, won. The cap keeps the large products (and every LM head) on cuBLAS; above 8 rows
//   cuBLAS keeps them all (session 15: 32 rows lost on llama-1B too).
constexpr int kDefaultMaxRows = 8;
constexpr int kMinRows = 2;  // MLX_INFER_GEMV_MIN_ROWS=1 sends one-row products here too
constexpr long kDefaultMaxWeightMiB = 64;
constexpr long kMaxWeightMiBLimit = 1L << 20;
constexpr int kMaxRows = 64;         // the tensor-core form's kMT m-tiles of 16 rows
constexpr int kCoreRowsDefault = 1;  // above this many rows the default tiling is the tensor-core form

// Template constants: T (x, w, bias and y's dtype), kM (rows of x), kR (rows of w per warp), kNW (warps per
// block), kU (chunks per lane per iteration), kBias (bool). x (kM, K), w (N, K), bias (N,) (read only with kBias).
constexpr const char* kSource = R"(
  constexpr int kC = 16 / sizeof(T);  // elements per 16-byte chunk
  using V = AlignedVector<T, kC>;
  const int N = w_shape[0];
  const int chunks = w_shape[1] / kC;  // per row of w and x (K % kC == 0)
  const int lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * kNW + threadIdx.x / 32) * kR;
  if (n0 >= N) return;
  const V* wv = reinterpret_cast<const V*>(w);
  const V* xv = reinterpret_cast<const V*>(x);
  float acc[kR][kM];
  #pragma unroll
  for (int r = 0; r < kR; ++r) {
    #pragma unroll
    for (int m = 0; m < kM; ++m) acc[r][m] = 0.0f;
  }
  size_t row[kR];  // the first chunk of each of the warp's rows (a row past N repeats the last, never stored)
  #pragma unroll
  for (int r = 0; r < kR; ++r) row[r] = (size_t)min(n0 + r, N - 1) * chunks;
  for (int c0 = lane; c0 < chunks; c0 += 32 * kU) {
    V wc[kU][kR];  // every load of the iteration is issued before the first is used
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int c = min(c0 + u * 32, chunks - 1);
      #pragma unroll
      for (int r = 0; r < kR; ++r) wc[u][r] = wv[row[r] + c];
    }
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int c = c0 + u * 32;
      if (c >= chunks) break;
      #pragma unroll
      for (int m = 0; m < kM; ++m) {
        const V xc = xv[(size_t)m * chunks + c];
        #pragma unroll
        for (int e = 0; e < kC; ++e) {
          const float xf = static_cast<float>(xc[e]);
          #pragma unroll
          for (int r = 0; r < kR; ++r) acc[r][m] = fmaf(static_cast<float>(wc[u][r][e]), xf, acc[r][m]);
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < kR; ++r) {
    #pragma unroll
    for (int m = 0; m < kM; ++m) {
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], o);
    }
  }
  if (lane == 0) {
    #pragma unroll
    for (int r = 0; r < kR; ++r) {
      const int n = n0 + r;
      if (n >= N) break;
      const float b = kBias ? static_cast<float>(bias[n]) : 0.0f;
      #pragma unroll
      for (int m = 0; m < kM; ++m) y[(size_t)m * N + n] = static_cast<T>(acc[r][m] + b);
    }
  }
)";

// The tensor-core form, for 16-bit x and w and more rows (mma.sync m16n8k16, float32 accumulation): a block owns
// kNT x 8 rows of w and its kNW warps split K; lane (g, t) = (lane / 4, lane % 4) loads 16 bytes of w's row n0 + g at
// k = 32 s + 8 t (s: the step) and the same 16 bytes of x's rows. The dot product is over K, so any permutation
// of K taken alike by x and w leaves it unchanged: a lane's 8 elements are its 4 k-pairs of two mma steps
// (logical k 2t, 2t+1 and 2t+8, 2t+9 of each), which is what lets w's fragments come straight from 16-byte
// loads. kMT m-tiles of 16 rows of x (rows past M are zeros, never stored); kNT n-tiles of 8 rows of w per block
// share each A fragment (x is read from L2 once per block: more n-tiles, less of that traffic). Template
// constants: T, kMT, kNT, kNW, kU (steps in flight per lane), kBias. x (M, K), w (N, K), K a multiple of 32.

constexpr const char* kMmaSource = R"(
  using V8 = AlignedVector<T, 8>;
  const int N = w_shape[0], K = w_shape[1], M = x_shape[0];
  const int steps = K / 32, rowv = K / 8;  // steps per row; 8-element vectors per row
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * 8 * kNT;
  const V8* wv[kNT];  // this lane's row of each n-tile (a row past N repeats the last, never stored)
  #pragma unroll
  for (int nt = 0; nt < kNT; ++nt) wv[nt] = reinterpret_cast<const V8*>(w) + (size_t)min(n0 + nt * 8 + g, N - 1) * rowv + t;
  const V8* xv = reinterpret_cast<const V8*>(x) + t;
  // The 4 k-pairs of x's row ``m`` at step s in this lane's chunk (zeros past M).
  auto x_pairs = [&](int m, int s, MlxiFrag* p) {
    if (m < M) {
      const V8 v = xv[(size_t)m * rowv + (size_t)s * 4];
      #pragma unroll
      for (int j = 0; j < 4; ++j) p[j] = mlxi_pair(v, j);
    } else {
      #pragma unroll
      for (int j = 0; j < 4; ++j) p[j] = mlxi_zero_pair();
    }
  };
  float c[kNT][kMT][4];
  #pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    #pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      #pragma unroll
      for (int j = 0; j < 4; ++j) c[nt][mt][j] = 0.0f;
    }
  }
  for (int s0 = warp * kU; s0 < steps; s0 += kNW * kU) {
    V8 wc[kU][kNT];  // every load of w in the iteration is issued before the first is used
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      #pragma unroll
      for (int nt = 0; nt < kNT; ++nt) wc[u][nt] = wv[nt][(size_t)min(s0 + u, steps - 1) * 4];
    }
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int s = s0 + u;
      if (s >= steps) break;  // the same in every lane of the warp
      #pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const int lo = mt * 16 + g, hi = lo + 8;  // x's rows in this lane's A fragments, read once for every n-tile
        MlxiFrag xl[4], xh[4];
        x_pairs(lo, s, xl);
        x_pairs(hi, s, xh);
        const MlxiFrag a1[4] = {xl[0], xh[0], xl[1], xh[1]};
        const MlxiFrag a2[4] = {xl[2], xh[2], xl[3], xh[3]};
        #pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const MlxiFrag b1[2] = {mlxi_pair(wc[u][nt], 0), mlxi_pair(wc[u][nt], 1)};
          const MlxiFrag b2[2] = {mlxi_pair(wc[u][nt], 2), mlxi_pair(wc[u][nt], 3)};
          mlxi_mma((const T*)nullptr, c[nt][mt], a1, b1);
          mlxi_mma((const T*)nullptr, c[nt][mt], a2, b2);
        }
      }
    }
  }
  // kMmaStore (gemv_common.h) follows: the warps' partial sums meet in shared memory, warp 0 stores y.
)";

const ReusedKernel& kernel(bool mma) {
  static std::once_flag once;
  static ReusedKernel fns[2];
  std::call_once(once, [] {
    fns[0] = ReusedKernel(mx::fast::cuda_kernel("mlxi_gemv", {"x", "w", "bias"}, {"y"}, kSource, ""));
    fns[1] = ReusedKernel(mx::fast::cuda_kernel("mlxi_gemv_mma", {"x", "w", "bias"}, {"y"},
                                                std::string(kMmaSource) + kMmaStore, kMmaHeader));
  });
  return fns[mma ? 1 : 0];
}

// Whether the tensor-core form takes w: 16-bit, K a multiple of 32.
bool mma_takes(const mx::array& w) {
  return (w.dtype() == mx::bfloat16 || w.dtype() == mx::float16) && w.shape(1) % 32 == 0;
}

// The most rows the CUDA-core form takes (its kR x kM accumulators per lane).
constexpr int kMaxCoreRows = 16;

}  // namespace

// Read at each call (a graph's trace), so a process can compare both paths.
long gemv_max_weight_mib() {
  return env_int("MLX_INFER_GEMV_MAX_MIB", 0, kMaxWeightMiBLimit, kDefaultMaxWeightMiB, "0: no cap");
}

// Read at each call: whether one-row products take the kernel too (MLX_INFER_GEMV_MIN_ROWS=1; default 2, MLX's own
// GEMV, which session 21 measured as fast on a host-bound llama-1B step; the device-bound llama-8B step is the
// open question).
int gemv_min_rows() {
  return static_cast<int>(env_int("MLX_INFER_GEMV_MIN_ROWS", 1, 2, kMinRows, "1: one-row products too"));
}

bool gemv_takes(int rows, std::int64_t weight_bytes) {
  if (rows < gemv_min_rows() || rows > gemv_max_rows()) {
    return false;
  }
  const long cap = gemv_max_weight_mib();
  return cap == 0 || weight_bytes <= static_cast<std::int64_t>(cap) * (1 << 20);
}

// Read at each call (a graph's trace), so a process can compare both paths.
int gemv_max_rows() {
  return static_cast<int>(
      env_int("MLX_INFER_GEMV_ROWS", 0, kMaxRows, kDefaultMaxRows, "0: never use the GEMV kernel"));
}

GemvTiling default_gemv_tiling(int rows, int n, int k, mx::Dtype dtype) {
  GemvTiling t;
  const bool mma_ok = (dtype == mx::bfloat16 || dtype == mx::float16) && k % 32 == 0;
  if (mma_ok && rows > kCoreRowsDefault) {
    t.mma = true;
    t.rows_per_warp = rows > 16 ? 2 : 1;  // n-tiles per block
    t.warps = 4;
    t.unroll = 8;
    return t;
  }
  // Two rows of w per warp once there are enough of them to fill the GPU with warps; more chunks in
  // flight per lane for long rows.
  t.rows_per_warp = n >= 2048 && rows <= 4 ? 2 : 1;
  t.warps = 4;
  t.unroll = k >= 2048 ? 8 : 4;
  return t;
}

bool skinny_linear_applies(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                           mx::StreamOrDevice s) {
  const int rows = product_rows(x);
  if (!cuda_backend() || mx::to_stream(s).device != mx::Device::gpu || !gemv_takes(rows, w.nbytes())) {
    return false;
  }
  if (w.ndim() != 2 || x.shape(-1) != w.shape(1) || x.dtype() != w.dtype() || !cuda_float_dtype(w.dtype()) ||
      w.shape(0) == 0 || w.shape(1) % (16 / static_cast<int>(mx::size_of(w.dtype()))) != 0 ||
      (rows > kMaxCoreRows && !mma_takes(w))) {
    return false;
  }
  return !bias || (bias->dtype() == w.dtype() && bias->ndim() == 1 && bias->shape(0) == w.shape(0));
}

mx::array skinny_linear(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                        std::optional<GemvTiling> tiling, mx::StreamOrDevice s) {
  const int rows = product_rows(x);
  if (w.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != w.shape(1) || rows < 1 || rows > kMaxRows ||
      x.dtype() != w.dtype() || !cuda_float_dtype(w.dtype()) || w.shape(1) % (16 / mx::size_of(w.dtype())) != 0) {
    throw std::invalid_argument(
        "[skinny_linear] takes x (..., K) with 1 to " + std::to_string(kMaxRows) + " rows and w (N, K), one " +
        "float dtype, K a multiple of 16 bytes; got x " + shape_text(x.shape()) + " and w " + shape_text(w.shape()) +
        ". Use mx.matmul(x, w.T) for other shapes.");
  }
  if (bias && (bias->ndim() != 1 || bias->shape(0) != w.shape(0) || bias->dtype() != w.dtype())) {
    throw std::invalid_argument("[skinny_linear] bias must be (N,) = (" + std::to_string(w.shape(0)) +
                                ",) of w's dtype; got " + shape_text(bias->shape()) + ".");
  }
  const int n = w.shape(0), k = w.shape(1);
  const auto t = tiling.value_or(default_gemv_tiling(rows, n, k, w.dtype()));
  if (t.rows_per_warp < 1 || t.rows_per_warp > 4 || t.warps < 1 || t.warps > 16 || t.unroll < 1 || t.unroll > 16) {
    throw std::invalid_argument("[skinny_linear] tiling must have rows_per_warp in [1, 4], warps in [1, 16] and "
                                "unroll in [1, 16]; got " + std::to_string(t.rows_per_warp) + ", " +
                                std::to_string(t.warps) + ", " + std::to_string(t.unroll) + ".");
  }
  if (t.mma && !mma_takes(w)) {
    throw std::invalid_argument("[skinny_linear] the tensor-core form takes bfloat16/float16 w with K a multiple of "
                                "32; got " + shape_text(w.shape()) + ". Use the CUDA-core form (mma=False).");
  }
  if (t.mma && t.warps * t.rows_per_warp * ((rows + 15) / 16) * 4 * 32 * 4 > 48 * 1024) {
    throw std::invalid_argument("[skinny_linear] the tensor-core form's partial sums (warps x n-tiles x m-tiles x "
                                "2 KiB) must fit 48 KiB of shared memory; got " + std::to_string(t.warps) + " x " +
                                std::to_string(t.rows_per_warp) + " x " + std::to_string((rows + 15) / 16) +
                                ". Use fewer warps or n-tiles.");
  }
  if (!t.mma && rows > kMaxCoreRows) {
    throw std::invalid_argument("[skinny_linear] the CUDA-core form takes at most " + std::to_string(kMaxCoreRows) +
                                " rows; got " + std::to_string(rows) + ". Use the tensor-core form (mma=True).");
  }
  const auto stream = mx::to_stream(s);
  if (!cuda_backend() || stream.device != mx::Device::gpu) {
    throw std::invalid_argument("[skinny_linear] runs on a GPU stream of MLX's CUDA backend only (its kernel is "
                                "compiled there by NVRTC); use mx.matmul(x, w.T) elsewhere.");
  }
  auto out_shape = x.shape();
  out_shape.back() = n;
  auto x2 = mx::reshape(x, {rows, k}, stream);  // (M, K)
  std::vector<mx::array> in{x2, w, bias ? *bias : x2};  // without a bias x stands in, never read
  mx::array y = x2;
  if (t.mma) {
    const int blocks = (n + 8 * t.rows_per_warp - 1) / (8 * t.rows_per_warp);  // rows_per_warp n-tiles of 8 rows
    y = kernel(true)(in, {{rows, n}}, {w.dtype()}, {blocks * t.warps * 32, 1, 1}, {t.warps * 32, 1, 1},
                     {{"T", w.dtype()}, {"kMT", (rows + 15) / 16}, {"kNT", t.rows_per_warp}, {"kNW", t.warps},
                      {"kU", t.unroll},
                      {"kBias", bias.has_value()}},
                     std::nullopt, false, stream)[0];  // (M, N)
  } else {
    const int warps_needed = (n + t.rows_per_warp - 1) / t.rows_per_warp;
    const int blocks = (warps_needed + t.warps - 1) / t.warps;
    y = kernel(false)(in, {{rows, n}}, {w.dtype()}, {blocks * t.warps * 32, 1, 1}, {t.warps * 32, 1, 1},
                      {{"T", w.dtype()}, {"kM", rows}, {"kR", t.rows_per_warp}, {"kNW", t.warps},
                       {"kU", t.unroll}, {"kBias", bias.has_value()}},
                      std::nullopt, false, stream)[0];  // (M, N)
  }
  return mx::reshape(y, out_shape, stream);
}

mx::array dense_linear(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                       mx::StreamOrDevice s) {
  if (skinny_linear_applies(x, w, bias, s)) {
    return skinny_linear(x, w, bias, std::nullopt, s);
  }
  if (bias) {
    return mx::addmm(*bias, x, mx::transpose(w, s), 1.0f, 1.0f, s);
  }
  return mx::matmul(x, mx::transpose(w, s), s);
}

}  // namespace mlx_infer
