// Internal to cpp/decode/: the weights of a decode step and its one-token forward.
#pragma once

#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "mlx_infer/decode.h"

namespace mlx_infer {

/// A dense or affine-quantized linear (``y = x W^T (+ bias)``).
struct Linear {
  std::optional<mx::array> w;
  std::optional<mx::array> scales;  // set when quantized
  std::optional<mx::array> biases;  // quantization biases
  std::optional<mx::array> bias;    // the layer's additive bias
  int group_size = 0;
  int bits = 0;
  std::string mode = "affine";
  bool fast = false;  // product on mlx-infer's CPU kernels (mlx_infer/matmul.h), as the model's layer

  bool present() const { return w.has_value(); }
  bool quantized() const { return scales.has_value(); }
};

struct LayerWeights {
  Linear q, k, v, o, gate, up, down;
  Linear qkv, gate_up;  // fused forms, when DecodeConfig::fuse_projections allows
  std::optional<mx::array> attn_norm, mlp_norm, post_attn_norm, post_mlp_norm, q_norm, k_norm;
  int window = 0;
  RopeSpec rope;
};

struct DecodeStep::Graph {
  DecodeConfig cfg;
  Linear embed;
  Linear lm_head;  // absent (w unset) when the head is tied to the embedding
  std::optional<mx::array> norm;
  std::vector<LayerWeights> layers;
  mx::Dtype dtype = mx::float32;  // activations
  int traces = 0;
};

/// How attention reads the buffers in one forward.
struct AttentionRead {
  /// Set when every row holds the same number of tokens after this step's
  /// write and the graph is not traced for reuse: read ``[:length]`` views
  /// with no mask (what lets a GPU use its fused decode-attention kernel).
  std::optional<int> uniform_length;
};

/// What one layer's attention reads after its new token was written.
struct AttentionInputs {
  mx::array keys;                 // (B, KVH, S, D)
  mx::array values;               // (B, KVH, S, D)
  std::optional<mx::array> mask;  // (B, 1, 1, S) bool, or none: every key visible
};

/// Where a forward's K/V live: the contiguous buffers of DecodeStep or the
/// pages of a paged store (paged_step.cpp). The layer code calls it once per
/// layer; an implementation keeps the updated storage it builds as its output.
class KVAccess {
 public:
  virtual ~KVAccess() = default;
  /// Writes layer ``layer``'s new ``k``, ``v`` (B, KVH, 1, D), RoPE applied, and
  /// returns what its attention reads.
  virtual AttentionInputs write_read(int layer, const mx::array& k, const mx::array& v) = 0;
};

/// The one-token forward over any KV storage: logits (B, vocab), lazily.
mx::array decode_layers(
    const DecodeStep::Graph& g,
    const mx::array& tokens,
    const mx::array& positions,
    KVAccess& kv);

/// The one-token forward over DecodeStep's buffers.
///
/// inputs:  tokens (B,), positions (B,) int32, k_0, v_0, ..., k_{L-1}, v_{L-1}
/// outputs: logits (B, vocab), positions + 1, k_0', v_0', ...
std::vector<mx::array> decode_forward(
    const DecodeStep::Graph& g,
    const std::vector<mx::array>& inputs,
    const AttentionRead& read);

/// Raises std::invalid_argument naming the first field of ``c`` that is out of range.
void validate_decode_config(const DecodeConfig& c);

/// Builds the graph's weights from canonical names (see decode.h).
void load_graph_weights(
    DecodeStep::Graph& g,
    const std::unordered_map<std::string, mx::array>& weights,
    const std::unordered_map<std::string, QuantSpec>& quantization);

}  // namespace mlx_infer
