// Attention sizing: SDPA fallback workspace, prefill chunk size, KV bytes.
// Pure arithmetic over a model's attention geometry; no arrays involved.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace mlx_infer {

/// The attention shape of a model, as the sizing functions need it.
struct Geometry {
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int n_layers = 0;
  /// Sliding window per layer (0 = global attention); empty = all global.
  std::vector<int> layer_windows;
  /// Bytes of one activation / KV element (bf16: 2).
  int dtype_bytes = 2;
};

/// Throws std::invalid_argument("[fn] ...") naming the bad field.
void validate_geometry(const Geometry& g, const char* fn = "Geometry");

inline constexpr int64_t kDefaultWorkspaceBudget = int64_t{1} << 30;  // 1 GiB
inline constexpr int kMaxPrefillChunk = 2048;
inline constexpr int kMinPrefillChunk = 8;

/// Transient bytes of the attention-score workspace one layer materializes
/// when no fused SDPA kernel applies, for the worst (last) chunk of a prompt;
/// the maximum over layers, since layers run one after another.
///
///   queries = min(chunk, prompt_tokens)
///   keys    = prompt_tokens                          global layer
///           = min(prompt_tokens, window + chunk)     windowed layer
///   bytes   = n_heads * queries * keys * (4 + dtype_bytes)
///             (scores bounded as float32, plus the softmax output)
///
/// A bound, not a prediction: MLX keeps scores in the input dtype and its
/// where/softmax reuse the score buffer when they can, so the measured CPU
/// peak is about n_heads * queries * keys * dtype_bytes.
int64_t sdpa_fallback_bytes(const Geometry& g, int64_t chunk, int64_t prompt_tokens);

/// Prefill chunk: `explicit_chunk` (> 0) exactly; otherwise 2048, halved
/// while the SDPA fallback workspace exceeds `budget_bytes`, never below 8.
int prefill_chunk_size(
    const Geometry& g,
    int64_t prompt_tokens,
    int64_t budget_bytes = kDefaultWorkspaceBudget,
    int explicit_chunk = 0);

/// KV bytes one token adds across all layers while it is inside every
/// layer's window. kv_bits 16/32: plain elements of that width (dtype_bytes
/// is ignored); 2..8: MLX affine quantization, packed bits plus a scale and
/// a bias of dtype_bytes per `group_size` elements.
int64_t kv_bytes_per_token(const Geometry& g, int kv_bits = 16, int group_size = 64);

/// KV bytes of a context of `tokens` tokens: windowed layers hold at most
/// their window.
int64_t kv_bytes_for_context(
    const Geometry& g, int64_t tokens, int kv_bits = 16, int group_size = 64);

/// The longest context whose KV fits in `budget_bytes`; nullopt when every
/// layer is windowed and all windows fit (the context is then unbounded).
std::optional<int64_t> max_context_for_budget(
    const Geometry& g, int64_t budget_bytes, int kv_bits = 16, int group_size = 64);

}  // namespace mlx_infer
