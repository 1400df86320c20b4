// Attention whose scores are soft-capped (Gemma 2: ``cap * tanh(scores / cap)`` before the mask and
// the softmax), composed of MLX ops: MLX's fused SDPA has no soft cap (cpp/attention/softcap_attention.cpp).
#pragma once

#include <optional>

#include <mlx/mlx.h>

namespace mlx_infer {

namespace mx = mlx::core;

/// The ops of ``mlx_infer.layers.attention.softcapped_attention``, in its order, so a compiled step's
/// scores round as the eager graph's do: ``q * scale``, ``q @ kᵀ`` (GQA by a reshape), the cap, the mask
/// (bool: false -> the dtype's lowest; float: added), a precise softmax, ``@ v``. With ``sinks`` (H,) each
/// head's sink logit joins its softmax as a score with no value, as MLX's SDPA composes it (gpt-oss).
///
/// q (B, H, L, D), k (B, KVH, S, D), v (B, KVH, S, Dv), H a multiple of KVH; mask broadcastable to
/// (B, H, L, S) or none; softcap > 0 (0 runs no cap: plain composed attention). -> (B, H, L, Dv).
mx::array softcapped_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    float softcap,
    const std::optional<mx::array>& mask = std::nullopt,
    const std::optional<mx::array>& sinks = std::nullopt,
    mx::StreamOrDevice s = {});

}  // namespace mlx_infer
