// quantized_linear (mlx_infer/matmul.h): `x @ dequantize(w).T` for MLX's affine 4- and 8-bit weights on CUDA, our
// fused dequantizing GEMV kernel for a few rows of x; MLX's quantized_matmul for everything else.
//
// Why (benchmarks/RESULTS.md, "Session 31"): on an H100 MLX 0.32.4's CUDA quantized products stream a 4-bit
// weight at 0.3-1.0 TB/s of the 3.35 the GPU has (qmv_kernel, one row: 13.7 us for 4096 x 4096, 37.1 us for
// 14336 x 4096, Nsight Compute), 8-bit at 0.4-2.4 TB/s; two rows run qmv once per row (twice the time) and eight
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
// Above a few rows that per-value work grows with the rows (8 rows: compute-bound on the large products, where
// MLX's tensor-core qmm wins); the tensor-core form (kQMmaSource, 16-bit x, up to 64 rows) unpacks each value once
// for all rows and hands the multiply-adds to mma.sync. Compiled at run time by NVRTC through mx::fast::cuda_kernel
// (inside mx::compile'd graphs like any op), one module per (form, dtype, bits, group size, rows, tiling).
#include "mlx_infer/backend.h"
#include "mlx_infer/matmul.h"
#include "mlx_infer/text.h"
#include "gemv_common.h"

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
// 1024-4096-row products and down (14-126 against 47-184 us) but loses on gate/up and the head (128-1,129 against
// 59-266 us). So 1 to 4 rows by default (3 and 4 run as MLX's 3-4 qmv passes; not yet timed on their own).
constexpr int kDefaultMaxRows = 4;
constexpr int kMaxRows = 64;     // the tensor-core form's kMT m-tiles of 16 rows
constexpr int kMaxCoreRows = 8;  // the CUDA-core form's kR x kM accumulators per lane, each with its chunk's sums
constexpr int kCoreRowsDefault = 4;  // above this many rows the default tiling is the tensor-core form

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

// The tensor-core form, for 16-bit x and more rows: each value is unpacked once for all rows of x, the multiply-adds
// go to mma.sync (m16n8k16, float32 accumulation). As gemv_cuda.cpp's kMmaSource: a block owns kNT n-tiles of 8
// rows of w, its kNW warps split K, lane (g, t) = (lane / 4, lane % 4) feeds w's row n0 + g (every n-tile) and x's
// rows g and g + 8 (every m-tile of 16 rows; rows past M are zeros, never stored). Lane t takes the 16-byte chunk
// 4 S + t of each row at super-step S (so the 4 lanes of a row read 64 contiguous bytes), i.e. kE values from
// k0 = (4 S + t) kE, in sub-steps of 8 values; as the dot product is over K, any permutation of K taken alike by
// x and w leaves it unchanged, and a sub-step's 8 values j = 0..7 become the k-pairs (j, j + 4), j = 0..3: pairs
// 0-1 feed one mma, 2-3 the next. A value is dequantized as `scale * q + bias` with q exact and one rounding to T
// for the fragment, as MLX's dequantize does: 4-bit values by mlxi_dequant4's 16-bit bit trick, 8-bit in float32. Template constants: T (16-bit), kBits, kG,
// kMT, kNT, kNW, kU (super-steps in flight per lane). x (M, K), w (N, K bits / 32) uint32, scales and biases
// (N, K / kG); K bits / 32 a multiple of 16 (whole super-steps).
constexpr const char* kQMmaHeader = R"(
template <typename V>
__device__ __forceinline__ void mlxi_x_pairs(const V& v, MlxiFrag* p) {  // p[j] = (v[j], v[j + 4]), j = 0..3
  const uint32_t* u = reinterpret_cast<const uint32_t*>(&v);
  p[0] = __byte_perm(u[0], u[2], 0x5410);
  p[1] = __byte_perm(u[0], u[2], 0x7632);
  p[2] = __byte_perm(u[1], u[3], 0x5410);
  p[3] = __byte_perm(u[1], u[3], 0x7632);
}
__device__ __forceinline__ MlxiFrag mlxi_pack(const __nv_bfloat16*, float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<MlxiFrag*>(&h);
}
__device__ __forceinline__ MlxiFrag mlxi_pack(const __half*, float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<MlxiFrag*>(&h);
}
// A 4-bit word's values as the k-pairs (j, j + 4), j = 0..3, dequantized: nibbles j and j + 4 land in the two 16-bit
// halves, OR-ed into the bits of 128 (bfloat16) or 1024 (float16) they are exactly 128 + q / 1024 + q, one
// subtraction gives q exactly and one fused multiply-add scale * q + bias, rounded once: the same bits as
// mlxi_pack(fmaf(scale, q, bias), ...) in two instructions a pair instead of ~10.
__device__ __forceinline__ uint32_t mlxi_magic(const __nv_bfloat16*) { return 0x43004300u; }
__device__ __forceinline__ uint32_t mlxi_magic(const __half*) { return 0x64006400u; }
__device__ __forceinline__ MlxiFrag mlxi_fma_pair(const __nv_bfloat16*, uint32_t v, uint32_t magic, float s, float b) {
  const __nv_bfloat162 q = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&v), *reinterpret_cast<__nv_bfloat162*>(&magic));
  __nv_bfloat162 h = __hfma2(q, __float2bfloat162_rn(s), __float2bfloat162_rn(b));
  return *reinterpret_cast<MlxiFrag*>(&h);
}
__device__ __forceinline__ MlxiFrag mlxi_fma_pair(const __half*, uint32_t v, uint32_t magic, float s, float b) {
  const __half2 q = __hsub2(*reinterpret_cast<__half2*>(&v), *reinterpret_cast<__half2*>(&magic));
  __half2 h = __hfma2(q, __float2half2_rn(s), __float2half2_rn(b));
  return *reinterpret_cast<MlxiFrag*>(&h);
}
template <typename T>
__device__ __forceinline__ void mlxi_dequant4(const T* tag, uint32_t w, float s, float b, MlxiFrag* p) {
  const uint32_t magic = mlxi_magic(tag);
  #pragma unroll
  for (int j = 0; j < 4; ++j) p[j] = mlxi_fma_pair(tag, ((w >> (4 * j)) & 0x000F000Fu) | magic, magic, s, b);
}
)";

constexpr const char* kQMmaSource = R"(
  constexpr int kE = 128 / kBits;  // values per 16-byte chunk of w
  constexpr int kPerWord = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  using V8 = AlignedVector<T, 8>;
  using WV = AlignedVector<uint32_t, 4>;
  const int N = w_shape[0], M = x_shape[0];
  const int chunks = w_shape[1] / 4, K = chunks * kE, groups = K / kG, supers = chunks / 4;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * 8 * kNT;
  constexpr bool kBias = false;  // for kMmaStore: no bias input
  const T* bias = nullptr;
  const WV* wv = reinterpret_cast<const WV*>(w);
  const V8* xv = reinterpret_cast<const V8*>(x);
  int row[kNT];  // this lane's row of each n-tile (a row past N repeats the last, never stored)
  #pragma unroll
  for (int nt = 0; nt < kNT; ++nt) row[nt] = min(n0 + nt * 8 + g, N - 1);
  float c[kNT][kMT][4];
  #pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    #pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      #pragma unroll
      for (int j = 0; j < 4; ++j) c[nt][mt][j] = 0.0f;
    }
  }
  for (int s0 = warp * kU; s0 < supers; s0 += kNW * kU) {
    WV wc[kU][kNT];  // every load of w in the iteration is issued before the first is used
    float sc[kU][kNT], bi[kU][kNT];
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int ch = 4 * min(s0 + u, supers - 1) + t;
      #pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        wc[u][nt] = wv[(size_t)row[nt] * chunks + ch];
        sc[u][nt] = static_cast<float>(scales[(size_t)row[nt] * groups + ch * kE / kG]);
        bi[u][nt] = static_cast<float>(biases[(size_t)row[nt] * groups + ch * kE / kG]);
      }
    }
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int S = s0 + u;
      if (S >= supers) break;  // the same in every lane of the warp
      const int k0 = (4 * S + t) * kE;
      #pragma unroll
      for (int sub = 0; sub < kE / 8; ++sub) {
        MlxiFrag wp[kNT][4];  // w's k-pairs (j, j + 4) of this sub-step, dequantized
        #pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          if (kBits == 4) {  // one word: the 16-bit bit trick (mlxi_dequant4)
            mlxi_dequant4((const T*)nullptr, wc[u][nt][sub], sc[u][nt], bi[u][nt], wp[nt]);
            continue;
          }
          float wf[8];
          #pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int e = sub * 8 + j;
            const uint32_t q = (wc[u][nt][e / kPerWord] >> ((e % kPerWord) * kBits)) & kMask;
            wf[j] = fmaf(sc[u][nt], __uint_as_float(0x4B000000u | q) - 8388608.0f, bi[u][nt]);
          }
          #pragma unroll
          for (int j = 0; j < 4; ++j) wp[nt][j] = mlxi_pack((const T*)nullptr, wf[j], wf[j + 4]);
        }
        #pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const int lo = mt * 16 + g, hi = lo + 8;  // x's rows in this lane's A fragments, read once for every n-tile
          MlxiFrag xl[4], xh[4];
          #pragma unroll
          for (int j = 0; j < 4; ++j) xl[j] = xh[j] = mlxi_zero_pair();
          if (lo < M) mlxi_x_pairs(xv[((size_t)lo * K + k0) / 8 + sub], xl);
          if (hi < M) mlxi_x_pairs(xv[((size_t)hi * K + k0) / 8 + sub], xh);
          const MlxiFrag a1[4] = {xl[0], xh[0], xl[1], xh[1]};
          const MlxiFrag a2[4] = {xl[2], xh[2], xl[3], xh[3]};
          #pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            const MlxiFrag b1[2] = {wp[nt][0], wp[nt][1]};
            const MlxiFrag b2[2] = {wp[nt][2], wp[nt][3]};
            mlxi_mma((const T*)nullptr, c[nt][mt], a1, b1);
            mlxi_mma((const T*)nullptr, c[nt][mt], a2, b2);
          }
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
    fns[0] = ReusedKernel(mx::fast::cuda_kernel("mlxi_qgemv", {"x", "w", "scales", "biases"}, {"y"}, kSource, ""));
    fns[1] = ReusedKernel(mx::fast::cuda_kernel("mlxi_qgemv_mma", {"x", "w", "scales", "biases"}, {"y"},
                                                std::string(kQMmaSource) + kMmaStore,
                                                std::string(kMmaHeader) + kQMmaHeader));
  });
  return fns[mma ? 1 : 0];
}

// Whether the tensor-core form takes these: 16-bit x, whole super-steps (4 lanes x 16 bytes) along each row of w.
bool mma_takes(mx::Dtype dtype, long words_per_row) {
  return (dtype == mx::bfloat16 || dtype == mx::float16) && words_per_row % 16 == 0;
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

GemvTiling default_qgemv_tiling(int rows, int n, int k, int bits, mx::Dtype dtype) {
  GemvTiling t;
  if (mma_takes(dtype, static_cast<long>(k) * bits / 32) && rows > kCoreRowsDefault) {
    t.mma = true;
    t.rows_per_warp = n >= 8192 ? 4 : n >= 2048 ? 2 : 1;  // n-tiles of 8 rows per block: x read once for them all
    t.warps = 4;
    t.unroll = 2;  // super-steps (4 chunks of each row) in flight per lane
    return t;
  }
  t.rows_per_warp = n >= 2048 && rows <= 4 ? 2 : 1;
  t.warps = 4;
  t.unroll = static_cast<long>(k) * bits / 128 >= 32 * 4 ? 4 : 2;  // chunks per lane per iteration
  return t;
}

bool quantized_gemv_applies(const mx::array& x, const mx::array& w, const mx::array& scales,
                            const std::optional<mx::array>& biases, int group_size, int bits, const std::string& mode,
                            mx::StreamOrDevice s) {
  const int rows = product_rows(x);
  if (!cuda_backend() || mx::to_stream(s).device != mx::Device::gpu || rows < 1 || rows > qgemv_max_rows() ||
      !operand_problem(x, w, scales, biases, group_size, bits, mode).empty()) {
    return false;
  }
  return rows <= kMaxCoreRows || mma_takes(x.dtype(), w.shape(1));
}

mx::array quantized_gemv(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                         int group_size, int bits, std::optional<GemvTiling> tiling, mx::StreamOrDevice s) {
  const auto problem = operand_problem(x, w, scales, biases, group_size, bits, "affine");
  const int rows = product_rows(x);
  if (!problem.empty() || rows < 1 || rows > kMaxRows) {
    throw std::invalid_argument("[quantized_gemv] takes x (..., K) with 1 to " + std::to_string(kMaxRows) +
                                " rows and MLX's affine-quantized w, scales, biases (transposed product): " +
                                (problem.empty() ? "x has " + std::to_string(rows) + " rows" : problem) +
                                ". Use mx.quantized_matmul for other operands.");
  }
  const int n = w.shape(0), k = w.shape(1) * 32 / bits;
  const auto t = tiling.value_or(default_qgemv_tiling(rows, n, k, bits, x.dtype()));
  if (t.rows_per_warp < 1 || t.rows_per_warp > 4 || t.warps < 1 || t.warps > 16 || t.unroll < 1 || t.unroll > 8) {
    throw std::invalid_argument("[quantized_gemv] tiling must have rows_per_warp in [1, 4], warps in [1, 16] and "
                                "unroll in [1, 8]; got " + std::to_string(t.rows_per_warp) + ", " +
                                std::to_string(t.warps) + ", " + std::to_string(t.unroll) + ".");
  }
  if (t.mma && !mma_takes(x.dtype(), w.shape(1))) {
    throw std::invalid_argument("[quantized_gemv] the tensor-core form takes bfloat16/float16 x and w with K * bits "
                                "/ 32 a multiple of 16; got x " + std::string(dtype_text(x.dtype())) + ", w " +
                                shape_text(w.shape()) + ". Use the CUDA-core form (mma=False).");
  }
  if (!t.mma && rows > kMaxCoreRows) {
    throw std::invalid_argument("[quantized_gemv] the CUDA-core form takes at most " + std::to_string(kMaxCoreRows) +
                                " rows; got " + std::to_string(rows) + ". Use the tensor-core form (mma=True).");
  }
  const int mtiles = (rows + 15) / 16;
  if (t.mma && t.warps * t.rows_per_warp * mtiles * 4 * 32 * 4 > 48 * 1024) {
    throw std::invalid_argument("[quantized_gemv] the tensor-core form's partial sums (warps x n-tiles x m-tiles x "
                                "2 KiB) must fit 48 KiB of shared memory; got " + std::to_string(t.warps) + " x " +
                                std::to_string(t.rows_per_warp) + " x " + std::to_string(mtiles) +
                                ". Use fewer warps or n-tiles.");
  }
  const auto stream = mx::to_stream(s);
  if (!cuda_backend() || stream.device != mx::Device::gpu) {
    throw std::invalid_argument("[quantized_gemv] runs on a GPU stream of MLX's CUDA backend only (its kernel is "
                                "compiled there by NVRTC); use mx.quantized_matmul elsewhere.");
  }
  auto out_shape = x.shape();
  out_shape.back() = n;
  auto x2 = mx::reshape(x, {rows, k}, stream);  // (M, K)
  mx::array y = x2;
  if (t.mma) {
    const int blocks = (n + 8 * t.rows_per_warp - 1) / (8 * t.rows_per_warp);  // rows_per_warp n-tiles of 8 rows
    y = kernel(true)({x2, w, scales, biases}, {{rows, n}}, {x.dtype()}, {blocks * t.warps * 32, 1, 1},
                     {t.warps * 32, 1, 1},
                     {{"T", x.dtype()}, {"kBits", bits}, {"kG", group_size}, {"kMT", mtiles},
                      {"kNT", t.rows_per_warp}, {"kNW", t.warps}, {"kU", t.unroll}},
                     std::nullopt, false, stream)[0];  // (M, N)
  } else {
    const int warps_needed = (n + t.rows_per_warp - 1) / t.rows_per_warp;
    const int blocks = (warps_needed + t.warps - 1) / t.warps;
    y = kernel(false)({x2, w, scales, biases}, {{rows, n}}, {x.dtype()}, {blocks * t.warps * 32, 1, 1},
                      {t.warps * 32, 1, 1},
                      {{"T", x.dtype()}, {"kBits", bits}, {"kG", group_size}, {"kM", rows},
                       {"kR", t.rows_per_warp}, {"kNW", t.warps}, {"kU", t.unroll}},
                      std::nullopt, false, stream)[0];  // (M, N)
  }
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
