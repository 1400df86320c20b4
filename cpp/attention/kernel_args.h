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

}  // namespace mlx_infer
