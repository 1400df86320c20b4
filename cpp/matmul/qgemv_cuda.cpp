// quantized_linear (mlx_infer/matmul.h): `x @ dequantize(w).T` for MLX's affine 4- and 8-bit weights on CUDA, our
// fused dequantizing GEMV kernel for a few rows of x; MLX's quantized_matmul for everything else.
//
// Why (benchmarks/RESULTS.md, "Session 31"): on an H100 MLX 0.32.4's CUDA quantized products stream a 4-bit
// weight at 0.7-0.9 TB/s of the 3.35 the GPU has (qmv_kernel, one row: 13.7 us for 4096 x 4096, 37.1 us for
// 14336 x 4096, Nsight Compute), 8-bit at 1.3-1.8 TB/s; two rows run qmv once per row (twice the time) and eight
// go to qmm_sm80_kernel with 32-112 blocks on 132 SMs (58-185 us). So a 4-bit llama-8B decodes no faster than
// bf16 (products.py: the step's 4-bit products 6.1 ms at one row against bf16's 5.3), though it reads 3.6x fewer
// bytes. The work per weight is what bounds it: unpacking a 4-bit value and converting it to float.
//
// Here each warp owns kR rows of w and its lanes walk K in 16-byte chunks of packed weights (32 4-bit or 16 8-bit
// values, inside one group since every group size MLX allows is a multiple of 32 values), kU chunks per lane
// loaded at once with their groups' scales and biases, before any is used. A value q becomes a float without a
// conversion instruction: `0x4B000000 | q` is the float 2^23 + q exactly, one subtraction gives q (exact). With
// `w = scale * q + bias` per group, a chunk adds `scale * sum(q x) + bias * sum(x)` to each (row of w, row of x):
// the sum of x is shared by the warp's kR rows, so the per-value work is one mask, one shift, one subtraction and
// kM multiply-adds. float32 accumulation, one rounding to x's dtype at the end, the kM rows of x read from L1/L2
// beside the weights (they are small), so the weights are read once for every row of x.
// Compiled at run time by NVRTC through mx::fast::cuda_kernel (inside mx::compile'd graphs like any op), one
// module per (dtype, bits, group size, rows, tiling).
#include "mlx_infer/backend.h"
#include "mlx_infer/matmul.h"
#include "mlx_infer/text.h"

#include <mlx/fast.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace mlx_infer {

namespace {

// The most rows of x quantized_linear sends to the kernel where MLX_INFER_QGEMV_ROWS is unset. Measured (session 31,
// H100, Nsight Compute with the caches flushed, benchmarks/quantized_kernels.py, every llama-8B product): at 1 row
// the kernel takes 0.52-0.92x MLX's qmv time at 4 bits (gate 21.7 against 37.1 us, the head 150 against 288) and
// 0.68-0.88x at 8; at 2 rows, which MLX runs as two qmv passes, 0.38-0.86x (gate 29.2 against 69.2 us). At 8 rows
// MLX switches to its tensor-core qmm_sm80 and the kernel, whose multiply-adds grow with the rows, wins on the
// 1024-4096-row products (14-40 against 47-58 us) but loses on gate/up/down and the head (126-1,129 against
// 59-266 us). So 1 to 4 rows by default (3 and 4 run as MLX's 3-4 qmv passes; not yet timed on their own).
constexpr int kDefaultMaxRows = 4;
constexpr int kMaxRows = 8;  // kR x kM accumulators per lane, each with its chunk's partial sums

// Template constants: T (x, scales, biases and y's dtype), kBits (4 or 8), kG (values per group), kM (rows of x),
// kR (rows of w per warp), kNW (warps per block), kU (chunks per lane per iteration). x (kM, K), w (N, K bits / 32)
// uint32 (values least significant first), scales and biases (N, K / kG).
constexpr const char* kSource = R"(
  constexpr int kE = 128 / kBits;      // values per 16-byte chunk of w
  constexpr int kPerWord = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  constexpr int kXV = 16 / sizeof(T);  // values of x per 16-byte load
  using XV = AlignedVector<T, kXV>;
  using WV = AlignedVector<uint32_t, 4>;
  const int N = w_shape[0];
  const int chunks = w_shape[1] / 4;   // per row of w
  const int K = chunks * kE;
  const int groups = K / kG;
  const int lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * kNW + threadIdx.x / 32) * kR;
  if (n0 >= N) return;
  const WV* wv = reinterpret_cast<const WV*>(w);
  const XV* xv = reinterpret_cast<const XV*>(x);
  float acc[kR][kM];
  #pragma unroll
  for (int r = 0; r < kR; ++r) {
    #pragma unroll
    for (int m = 0; m < kM; ++m) acc[r][m] = 0.0f;
  }
  int row[kR];  // a row past N repeats the last, never stored
  #pragma unroll
  for (int r = 0; r < kR; ++r) row[r] = min(n0 + r, N - 1);
  for (int c0 = lane; c0 < chunks; c0 += 32 * kU) {
    WV wc[kU][kR];  // every load of the iteration is issued before the first is used
    float sc[kU][kR], bi[kU][kR];
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int c = min(c0 + u * 32, chunks - 1);
      const int g = c * kE / kG;
      #pragma unroll
      for (int r = 0; r < kR; ++r) {
        wc[u][r] = wv[(size_t)row[r] * chunks + c];
        sc[u][r] = static_cast<float>(scales[(size_t)row[r] * groups + g]);
        bi[u][r] = static_cast<float>(biases[(size_t)row[r] * groups + g]);
      }
    }
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int c = c0 + u * 32;
      if (c >= chunks) break;
      float dot[kR][kM], sx[kM];  // this chunk's sum(q x) per (row of w, row of x) and sum(x) per row of x
      #pragma unroll
      for (int m = 0; m < kM; ++m) {
        sx[m] = 0.0f;
        #pragma unroll
        for (int r = 0; r < kR; ++r) dot[r][m] = 0.0f;
      }
      #pragma unroll
      for (int v = 0; v < kE / kXV; ++v) {
        float q[kR][kXV];
        #pragma unroll
        for (int r = 0; r < kR; ++r) {
          #pragma unroll
          for (int e = 0; e < kXV; ++e) {
            const int j = v * kXV + e;
            const uint32_t bits = (wc[u][r][j / kPerWord] >> ((j % kPerWord) * kBits)) & kMask;
            q[r][e] = __uint_as_float(0x4B000000u | bits) - 8388608.0f;  // 2^23 + q - 2^23, exact
          }
        }
        #pragma unroll
        for (int m = 0; m < kM; ++m) {
          const XV xc = xv[((size_t)m * K + (size_t)c * kE) / kXV + v];
          #pragma unroll
          for (int e = 0; e < kXV; ++e) {
            const float xf = static_cast<float>(xc[e]);
            sx[m] += xf;
            #pragma unroll
            for (int r = 0; r < kR; ++r) dot[r][m] = fmaf(q[r][e], xf, dot[r][m]);
          }
        }
      }
      #pragma unroll
      for (int r = 0; r < kR; ++r) {
        #pragma unroll
        for (int m = 0; m < kM; ++m) acc[r][m] = fmaf(sc[u][r], dot[r][m], fmaf(bi[u][r], sx[m], acc[r][m]));
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
      #pragma unroll
      for (int m = 0; m < kM; ++m) y[(size_t)m * N + n] = static_cast<T>(acc[r][m]);
    }
  }
)";

const ReusedKernel& kernel() {
  static std::once_flag once;
  static ReusedKernel fn;
  std::call_once(once, [] {
    fn = ReusedKernel(mx::fast::cuda_kernel("mlxi_qgemv", {"x", "w", "scales", "biases"}, {"y"}, kSource, ""));
  });
  return fn;
}

int rows_of(const mx::array& x) {
  return x.ndim() == 0 || x.shape(-1) == 0 ? 0 : static_cast<int>(x.size() / x.shape(-1));
}

// What the kernel takes besides the rows and the device: affine values of 4 or 8 bits with biases, a group size
// MLX allows, x, scales and biases of one float dtype, w (N, K bits / 32) uint32 with K a whole number of 16-byte
// chunks, scales and biases (N, K / group_size). Empty when it takes them, else what is wrong.
std::string operand_problem(const mx::array& x, const mx::array& w, const mx::array& scales,
                            const std::optional<mx::array>& biases, int group_size, int bits, const std::string& mode) {
  if (mode != "affine" || !biases) {
    return "mode must be \"affine\" with biases; got \"" + mode + "\"" + (biases ? "" : " without biases");
  }
  if (bits != 4 && bits != 8) {
    return "bits must be 4 or 8; got " + std::to_string(bits);
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    return "group_size must be 32, 64 or 128; got " + std::to_string(group_size);
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || w.shape(0) == 0 || w.shape(1) % 4 != 0) {
    return "w must be (N, K * bits / 32) uint32 with K * bits / 32 a multiple of 4; got " + shape_text(w.shape());
  }
  const long k = static_cast<long>(w.shape(1)) * 32 / bits;
  if (x.ndim() < 1 || x.shape(-1) != k || !cuda_float_dtype(x.dtype())) {
    return "x must be (..., " + std::to_string(k) + ") of a float dtype; got " + shape_text(x.shape());
  }
  if (k % group_size != 0 || scales.ndim() != 2 || scales.shape(0) != w.shape(0) ||
      scales.shape(1) != k / group_size || scales.dtype() != x.dtype() || biases->shape() != scales.shape() ||
      biases->dtype() != x.dtype()) {
    return "scales and biases must be (" + std::to_string(w.shape(0)) + ", " + std::to_string(k / group_size) +
           ") of x's dtype; got " + shape_text(scales.shape()) + " and " + shape_text(biases->shape());
  }
  return "";
}

}  // namespace

// Read at each call (a graph's trace), so a process can compare both paths.
int qgemv_max_rows() {
  return static_cast<int>(
      env_int("MLX_INFER_QGEMV_ROWS", 0, kMaxRows, kDefaultMaxRows, "0: MLX's quantized_matmul for every product"));
}

GemvTiling default_qgemv_tiling(int rows, int n, int k, int bits) {
  GemvTiling t;
  t.rows_per_warp = n >= 2048 && rows <= 4 ? 2 : 1;
  t.warps = 4;
  t.unroll = static_cast<long>(k) * bits / 128 >= 32 * 4 ? 4 : 2;  // chunks per lane per iteration
  return t;
}

bool quantized_gemv_applies(const mx::array& x, const mx::array& w, const mx::array& scales,
                            const std::optional<mx::array>& biases, int group_size, int bits, const std::string& mode,
                            mx::StreamOrDevice s) {
  const int rows = rows_of(x);
  if (!cuda_backend() || mx::to_stream(s).device != mx::Device::gpu || rows < 1 || rows > qgemv_max_rows()) {
    return false;
  }
  return operand_problem(x, w, scales, biases, group_size, bits, mode).empty();
}

mx::array quantized_gemv(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                         int group_size, int bits, std::optional<GemvTiling> tiling, mx::StreamOrDevice s) {
  const auto problem = operand_problem(x, w, scales, biases, group_size, bits, "affine");
  const int rows = rows_of(x);
  if (!problem.empty() || rows < 1 || rows > kMaxRows) {
    throw std::invalid_argument("[quantized_gemv] takes x (..., K) with 1 to " + std::to_string(kMaxRows) +
                                " rows and MLX's affine-quantized w, scales, biases (transposed product): " +
                                (problem.empty() ? "x has " + std::to_string(rows) + " rows" : problem) +
                                ". Use mx.quantized_matmul for other operands.");
  }
  const int n = w.shape(0), k = w.shape(1) * 32 / bits;
  const auto t = tiling.value_or(default_qgemv_tiling(rows, n, k, bits));
  if (t.mma || t.rows_per_warp < 1 || t.rows_per_warp > 4 || t.warps < 1 || t.warps > 16 || t.unroll < 1 ||
      t.unroll > 8) {
    throw std::invalid_argument("[quantized_gemv] tiling must have rows_per_warp in [1, 4], warps in [1, 16], "
                                "unroll in [1, 8] and no tensor-core form; got " + std::to_string(t.rows_per_warp) +
                                ", " + std::to_string(t.warps) + ", " + std::to_string(t.unroll) + ".");
  }
  const auto stream = mx::to_stream(s);
  if (!cuda_backend() || stream.device != mx::Device::gpu) {
    throw std::invalid_argument("[quantized_gemv] runs on a GPU stream of MLX's CUDA backend only (its kernel is "
                                "compiled there by NVRTC); use mx.quantized_matmul elsewhere.");
  }
  auto out_shape = x.shape();
  out_shape.back() = n;
  auto x2 = mx::reshape(x, {rows, k}, stream);  // (M, K)
  const int warps_needed = (n + t.rows_per_warp - 1) / t.rows_per_warp;
  const int blocks = (warps_needed + t.warps - 1) / t.warps;
  auto y = kernel()({x2, w, scales, biases}, {{rows, n}}, {x.dtype()}, {blocks * t.warps * 32, 1, 1},
                    {t.warps * 32, 1, 1},
                    {{"T", x.dtype()}, {"kBits", bits}, {"kG", group_size}, {"kM", rows},
                     {"kR", t.rows_per_warp}, {"kNW", t.warps}, {"kU", t.unroll}},
                    std::nullopt, false, stream)[0];  // (M, N)
  return mx::reshape(y, out_shape, stream);
}

mx::array quantized_linear(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const std::optional<mx::array>& biases, int group_size, int bits, const std::string& mode,
                           mx::StreamOrDevice s) {
  if (quantized_gemv_applies(x, w, scales, biases, group_size, bits, mode, s)) {
    return quantized_gemv(x, w, scales, *biases, group_size, bits, std::nullopt, s);
  }
  return mx::quantized_matmul(x, w, scales, biases, /*transpose=*/true, group_size, bits, mode, s);
}

}  // namespace mlx_infer
