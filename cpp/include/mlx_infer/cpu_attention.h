// CPU attention: our SDPA primitive (cpp/attention/cpu_sdpa.cpp), the op MLX's CPU backend runs otherwise.
//
// It runs on the CPU kernels' thread pool and vector code (cpp/cpu_kernels/); on a GPU stream the call is MLX's own
// `mx::fast::scaled_dot_product_attention`, so a model can call it unconditionally.
#pragma once

#include <optional>
#include <string>

#include <mlx/mlx.h>

namespace mlx_infer {

namespace mx = mlx::core;

/// `mx::fast::scaled_dot_product_attention(q, k, v, scale, mask_mode, mask)`.
///
/// q (B, H, L, D), k (B, KVH, S, D), v (B, KVH, S, Dv), H a multiple of KVH,
/// one float dtype; mask_mode "" (none), "causal" (key s visible to query l
/// when s <= l + S - L) or "array" (bool: true = attend; float: added to the
/// scaled scores; broadcastable to (B, H, L, S)). Scores, softmax and the
/// weighted sum run in float32; keys past the causal limit are skipped, not
/// masked. A query that sees no key gets a zero row (MLX: NaN). Other inputs
/// and GPU streams get MLX's op.
mx::array fast_sdpa(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    const std::string& mask_mode = "",
    const std::optional<mx::array>& mask = std::nullopt,
    mx::StreamOrDevice s = {});

}  // namespace mlx_infer
