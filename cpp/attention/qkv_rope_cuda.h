// Internal to cpp/: a fused q|k|v product's output as contiguous q, k, v with RoPE on q and k, in one CUDA
// kernel (qkv_rope_cuda.cpp). The CPU and Metal graphs keep MLX's slices and mx::fast::rope.
#pragma once

#include <mlx/mlx.h>

#include <array>

#include "mlx_infer/decode.h"

namespace mlx_infer {

namespace mx = mlx::core;

/// Whether qkv_rope takes these: the CUDA backend, ``qkv`` (R, (H + 2 KVH) D) of a float dtype, an even
/// head_dim and rotated dims, RoPE by base or freqs without a YaRN magnitude correction or LongRoPE's
/// second (long) table.
bool qkv_rope_supported(const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope);

/// Whether the paged step uses qkv_rope where supported: MLX_INFER_QKV_ROPE=0 turns it off (MLX's split and
/// RoPE, as before), read once.
bool qkv_rope_enabled();

/// q (R, H, D), k (R, KVH, D), v (R, KVH, D), each contiguous, from ``qkv`` (R, (H + 2 KVH) D): q and k
/// rotated at ``positions`` (R,) as ``mx::fast::rope`` rotates them. With ``kv_write_rows`` k and v come
/// shaped (R KVH, 1, 1, 1, D), the same memory in the layout the paged step's K/V Scatter takes as its
/// updates, so no view sits between this kernel and the write (each graph node costs MLX's host time every
/// step). Call only where qkv_rope_supported.
std::array<mx::array, 3> qkv_rope(const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope,
                                  const mx::array& positions, bool kv_write_rows = false);

}  // namespace mlx_infer
