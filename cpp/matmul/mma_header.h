// The tensor-core fragments and mma.sync m16n8k16 (row.col, float32 accumulation) of the GEMV kernels' tensor-core
// forms (gemv_cuda.cpp's kMmaSource, qgemv_cuda.cpp's kQMmaSource): NVRTC source text, prepended as a kernel header.
// tests/cuda_emulation.py's _MMA_MOCK stands in for it on the CPU.
#pragma once

namespace mlx_infer {

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

}  // namespace mlx_infer
