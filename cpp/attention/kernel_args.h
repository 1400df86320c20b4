// Values handed to the NVRTC kernels (mx::fast::cuda_kernel) as template constants.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace mlx_infer {

// A non-negative finite float's bit pattern (``what`` names it in the error) as a template int (the kernel reads it back with
// __int_as_float). A constant instead of an input array: MLX allocates host-made arrays of <= 8 bytes in
// its mapped host pool (mlx/backend/cuda/allocator.cpp, the small pool), so every thread's read of such a
// "scale" array would cross to host memory. Non-negative because the value also names the kernel
// ("_<int>" in MLX's kernel name, where a minus sign is not an identifier character).
inline int float_bits(float x, const char* what) {
  if (std::signbit(x) || !std::isfinite(x)) {
    throw std::invalid_argument(std::string("[cuda kernel] ") + what + " must be finite and >= 0 (it is a kernel "
                                "template constant), got " + std::to_string(x) + ".");
  }
  std::int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

// A kernel header (mx::fast::cuda_kernel's ``header``): block_sum<kBlock>(v, warp_sums), a block's sum of one float
// a thread (a warp shuffle, then every warp's sum through ``warp_sums``, kBlock / 32 floats of shared memory),
// returned to every thread. kBlock: the block's threads, a multiple of 32.
inline constexpr const char* kBlockSumHeader = R"(
template <int kBlock>
__device__ __forceinline__ float block_sum(float v, float* warp_sums) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
  #pragma unroll
  for (int i = 0; i < kBlock / 32; ++i) total += warp_sums[i];
  return total;
}
)";

}  // namespace mlx_infer
