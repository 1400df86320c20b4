// Internal to cpp/: a residual add and the RMS norm after it, in one CUDA kernel (add_rms_norm_cuda.cpp). The CPU
// and Metal graphs keep MLX's add and mx::fast::rms_norm.
#pragma once

#include <mlx/mlx.h>

#include <utility>

namespace mlx_infer {

namespace mx = mlx::core;

/// Whether the decode graphs use add_rms_norm where supported: MLX_INFER_ADD_NORM=1 turns it on (off by default
/// until a device A/B shows it faster: benchmarks/h200_engine.sh s21a), read at each graph build.
bool add_rms_norm_enabled();

/// Whether add_rms_norm takes these: the CUDA backend on the default device, ``h`` and ``r`` (rows, E) of one
/// float dtype, ``w`` (E,) of it, E a multiple of 4 up to 65536, eps >= 0.
bool add_rms_norm_supported(const mx::array& h, const mx::array& r, const mx::array& w, float eps);

/// (s, n): s = h + r rounded to h's dtype, as MLX's add rounds it, and n = rms_norm(s, w, eps) as
/// mx::fast::rms_norm computes it on CUDA (float32 sum of squares, then w * T(s * rsqrt(mean + eps))); one launch,
/// one block a row. Call only where add_rms_norm_supported.
std::pair<mx::array, mx::array> add_rms_norm(const mx::array& h, const mx::array& r, const mx::array& w, float eps);

}  // namespace mlx_infer
