// What the GEMV kernels (gemv_cuda.cpp, qgemv_cuda.cpp) share: the rows of a product's x, and, for their tensor-core
// forms (kMmaSource, kQMmaSource), the fragments and mma.sync m16n8k16 (row.col, float32 accumulation) as NVRTC
// source text prepended as a kernel header (tests/cuda_emulation.py's _MMA_MOCK stands in for it on the CPU) and
// kMmaStore, their common last part.
#pragma once

#include <mlx/array.h>

namespace mlx_infer {

/// Rows of a product's x (..., K): x.size / K (0 for a scalar or K = 0).
inline int product_rows(const mlx::core::array& x) {
  return x.ndim() == 0 || x.shape(-1) == 0 ? 0 : static_cast<int>(x.size() / x.shape(-1));
}

inline constexpr const char* kMmaHeader = R"(
typedef uint32_t MlxiFrag;  // two 16-bit elements
template <typename V>
__device__ __forceinline__ MlxiFrag mlxi_pair(const V& v, int j) { return reinterpret_cast<const MlxiFrag*>(&v)[j]; }
__device__ __forceinline__ MlxiFrag mlxi_zero_pair() { return 0u; }
__device__ __forceinline__ void mlxi_mma(const __nv_bfloat16*, float* c, const MlxiFrag* a, const MlxiFrag* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mlxi_mma(const __half*, float* c, const MlxiFrag* a, const MlxiFrag* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
)";

// The tensor-core forms' last part (appended to their kernel text): the warps' partial sums c[kNT][kMT][4] over
// their share of K meet in shared memory, warp 0 adds them and stores y (M, N) as T, plus bias[n] where kBias. Reads
// the kernel's c, warp, lane, g, t, n0, M, N, y, kBias and bias (a kernel without a bias input declares kBias false
// and a null bias).
inline constexpr const char* kMmaStore = R"(
  __shared__ float part[kNW * kNT * kMT * 4 * 32];
  #pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    #pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      #pragma unroll
      for (int j = 0; j < 4; ++j) part[(((warp * kNT + nt) * kMT + mt) * 4 + j) * 32 + lane] = c[nt][mt][j];
    }
  }
  __syncthreads();
  if (warp == 0) {
    #pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      #pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
          float v = 0.0f;
          #pragma unroll
          for (int q = 0; q < kNW; ++q) v += part[(((q * kNT + nt) * kMT + mt) * 4 + j) * 32 + lane];
          const int m = mt * 16 + g + (j >= 2 ? 8 : 0), n = n0 + nt * 8 + 2 * t + (j & 1);
          if (m < M && n < N) {
            y[(size_t)m * N + n] = static_cast<T>(v + (kBias ? static_cast<float>(bias[n]) : 0.0f));
          }
        }
      }
    }
  }
)";

}  // namespace mlx_infer
