// Internal to cpp/attention/: paged_attention's CUDA kernels (paged_attention_cuda.cpp).
#pragma once

#include <mlx/mlx.h>

#include <optional>

namespace mlx_infer {

namespace mx = mlx::core;

/// Pass 1's key pipeline: ``unroll`` sets of keys per warp and iteration, ``prefetch`` the next iteration's
/// sets before this one's are scored. From MLX_INFER_PAGED_ATTN_UNROLL (1..8) and MLX_INFER_PAGED_ATTN_PREFETCH
/// (0/1), read at each call (a graph's trace), else the tuned defaults; a bad value is a clear error.
struct PagedKeyPipeline {
  int unroll = 1;
  bool prefetch = true;
};
PagedKeyPipeline paged_key_pipeline();

/// Whether the CUDA kernels take these inputs (head_dim, GQA group, dtypes); else the gather path.
bool cuda_paged_attention_supports(int H, int D, mx::Dtype q_dtype, const mx::array& k_storage);

/// paged_attention on a CUDA stream (inputs validated by the caller); (R, H, D), or (R, H D) with
/// ``flat_heads`` (the kernels write the same memory either way). ``split_counts``: see paged_attention.
mx::array cuda_paged_attention(const mx::array& q, const mx::array& k_storage, const mx::array& v_storage,
                               const mx::array& block_tables, const mx::array& lengths, int window, float scale,
                               float softcap, const std::optional<mx::array>& sinks, mx::Stream s,
                               bool flat_heads = false, const std::optional<mx::array>& split_counts = std::nullopt);

}  // namespace mlx_infer
