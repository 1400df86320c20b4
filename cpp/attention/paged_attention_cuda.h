// Internal to cpp/attention/: paged_attention's CUDA kernels (paged_attention_cuda.cpp).
#pragma once

#include <mlx/mlx.h>

#include <optional>

namespace mlx_infer {

namespace mx = mlx::core;

/// Whether the CUDA kernels take these inputs (head_dim, GQA group, dtypes); else the gather path.
bool cuda_paged_attention_supports(const mx::array& q, const mx::array& k_storage);

/// paged_attention on a CUDA stream (inputs validated by the caller).
mx::array cuda_paged_attention(const mx::array& q, const mx::array& k_storage, const mx::array& v_storage,
                               const mx::array& block_tables, const mx::array& lengths, int window, float scale,
                               float softcap, const std::optional<mx::array>& sinks, mx::Stream s);

}  // namespace mlx_infer
