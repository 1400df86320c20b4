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

#include <mlx/fast.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace mlx_infer {

namespace {

// Rows of x (products of the leading axes) up to which a dense CUDA product runs here, where
// MLX_INFER_GEMV_ROWS is unset (0 there: never).
constexpr int kDefaultMaxRows = 8;
constexpr int kMaxRows = 16;  // the kernel's accumulators are kR x kM floats per lane

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

const mx::fast::CustomKernelFunction& kernel() {
  static std::once_flag once;
  static mx::fast::CustomKernelFunction fn;
  std::call_once(once, [] { fn = mx::fast::cuda_kernel("mlxi_gemv", {"x", "w", "bias"}, {"y"}, kSource, ""); });
  return fn;
}

bool gemv_dtype(mx::Dtype t) { return t == mx::bfloat16 || t == mx::float16 || t == mx::float32; }

int rows_of(const mx::array& x) {
  return x.ndim() == 0 || x.shape(-1) == 0 ? 0 : static_cast<int>(x.size() / x.shape(-1));
}

}  // namespace

// Read at each call (a graph's trace), so a process can compare both paths.
int gemv_max_rows() {
  const char* v = std::getenv("MLX_INFER_GEMV_ROWS");
  if (v == nullptr || *v == '\0') {
    return kDefaultMaxRows;
  }
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > kMaxRows) {
    throw std::invalid_argument(std::string("MLX_INFER_GEMV_ROWS='") + v + "' is not an integer in [0, " +
                                std::to_string(kMaxRows) + "] (0: never use the GEMV kernel); unset it for " +
                                "the default " + std::to_string(kDefaultMaxRows) + ".");
  }
  return static_cast<int>(x);
}

GemvTiling default_gemv_tiling(int rows, int n, int k) {
  GemvTiling t;
  // Two rows of w per warp once there are enough of them to fill the GPU with warps; more chunks in
  // flight per lane for long rows. (The H200 sweep, benchmarks/products.py --gemv-sweep, chose these.)
  t.rows_per_warp = n >= 2048 && rows <= 4 ? 2 : 1;
  t.warps = 4;
  t.unroll = k >= 2048 ? 8 : 4;
  return t;
}

bool skinny_linear_applies(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                           mx::StreamOrDevice s) {
  const int rows = rows_of(x);
  if (!cuda_backend() || mx::to_stream(s).device != mx::Device::gpu || rows < 1 || rows > gemv_max_rows()) {
    return false;
  }
  const int c = 16 / static_cast<int>(mx::size_of(w.dtype()));
  return w.ndim() == 2 && x.shape(-1) == w.shape(1) && x.dtype() == w.dtype() && gemv_dtype(w.dtype()) &&
         w.shape(1) % c == 0 && w.shape(0) > 0 && (!bias || (bias->dtype() == w.dtype() && bias->ndim() == 1 &&
                                                           bias->shape(0) == w.shape(0)));
}

mx::array skinny_linear(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                        std::optional<GemvTiling> tiling, mx::StreamOrDevice s) {
  const int rows = rows_of(x);
  if (w.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != w.shape(1) || rows < 1 || rows > kMaxRows ||
      x.dtype() != w.dtype() || !gemv_dtype(w.dtype()) || w.shape(1) % (16 / mx::size_of(w.dtype())) != 0) {
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
  const auto t = tiling.value_or(default_gemv_tiling(rows, n, k));
  if (t.rows_per_warp < 1 || t.rows_per_warp > 4 || t.warps < 1 || t.warps > 16 || t.unroll < 1 || t.unroll > 16) {
    throw std::invalid_argument("[skinny_linear] tiling must have rows_per_warp in [1, 4], warps in [1, 16] and "
                                "unroll in [1, 16]; got " + std::to_string(t.rows_per_warp) + ", " +
                                std::to_string(t.warps) + ", " + std::to_string(t.unroll) + ".");
  }
  const auto stream = mx::to_stream(s);
  if (!cuda_backend() || stream.device != mx::Device::gpu) {
    throw std::invalid_argument("[skinny_linear] runs on a GPU stream of MLX's CUDA backend only (its kernel is "
                                "compiled there by NVRTC); use mx.matmul(x, w.T) elsewhere.");
  }
  auto out_shape = x.shape();
  out_shape.back() = n;
  auto x2 = mx::reshape(x, {rows, k}, stream);  // (M, K)
  const int warps_needed = (n + t.rows_per_warp - 1) / t.rows_per_warp;
  const int blocks = (warps_needed + t.warps - 1) / t.warps;
  std::vector<mx::array> in{x2, w, bias ? *bias : x2};  // without a bias x stands in, never read
  auto y = kernel()(in, {{rows, n}}, {w.dtype()}, {blocks * t.warps * 32, 1, 1}, {t.warps * 32, 1, 1},
                    {{"T", w.dtype()}, {"kM", rows}, {"kR", t.rows_per_warp}, {"kNW", t.warps},
                     {"kU", t.unroll}, {"kBias", bias.has_value()}},
                    std::nullopt, false, stream)[0];  // (M, N)
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
