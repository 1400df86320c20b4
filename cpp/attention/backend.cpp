// mlx_infer/backend.h: the backend query and the kernel limits the graphs work around.
#include "mlx_infer/backend.h"

#if __has_include(<mlx/backend/cuda/cuda.h>)  // every Linux wheel; maybe not a macOS one
#include <mlx/backend/cuda/cuda.h>
#define MLXI_HAS_CUDA_HEADER 1
#endif

#include <algorithm>

namespace mlx_infer {

bool cuda_backend() {
#ifdef MLXI_HAS_CUDA_HEADER
  static const bool yes = mlx::core::cu::is_available();
  return yes;
#else
  return false;
#endif
}

namespace {

// MLX's get_block_dims_common (mlx/backend/common/utils.cpp): powers of two over the three
// extents, one at a time in turn, up to 2^10 threads; the z extent it gives.
int mlx_block_z(int dim0, int dim1, int dim2) {
  int pows[3] = {0, 0, 0};
  int sum = 0;
  while (true) {
    const int presum = sum;
    if (dim0 >= (1 << (pows[0] + 1))) {
      ++pows[0];
      ++sum;
    }
    if (sum == 10) break;
    if (dim1 >= (1 << (pows[1] + 1))) {
      ++pows[1];
      ++sum;
    }
    if (sum == 10) break;
    if (dim2 >= (1 << (pows[2] + 1))) {
      ++pows[2];
      ++sum;
    }
    if (sum == presum || sum == 10) break;
  }
  return 1 << pows[2];
}

}  // namespace

int rope_rows_per_call(int B, int heads, int T, int dims, bool cuda) {
  constexpr int kMaxBlockZ = 64;  // CUDA's limit on blockDim.z
  if (!cuda || B <= 1) {
    return B;
  }
  const int groups = (heads + 3) / 4;  // the kernel's 4 heads per thread
  if (mlx_block_z(dims / 2, T, B * groups) <= kMaxBlockZ) {
    return B;
  }
  // z extents below 2 * kMaxBlockZ give a block z of at most kMaxBlockZ.
  return std::max(1, (2 * kMaxBlockZ - 1) / groups);
}

}  // namespace mlx_infer
