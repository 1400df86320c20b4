// Internal to cpp/decode/: the Gemma 4 (text) decode target.
//
// Canonical weight names beyond the shared ones (decode.h; Gemma 4's RMSNorms
// scale by ``w`` itself, so no ``1 +`` is folded in):
//
//   embed_per_layer.*            embed_tokens_per_layer (vocab, layers * P)   } with
//   per_layer_proj.*             per_layer_model_projection                   } per-layer
//   per_layer_proj_norm.weight   per_layer_projection_norm                    } inputs
//   layers.{i}.{q,k,v,o,gate,up,down}.*   k and v absent on KV-shared layers, v absent
//                                         with attention_k_eq_v (V = K's projection)
//   layers.{i}.{attn_norm,post_attn_norm,mlp_norm,post_mlp_norm,q_norm,k_norm}.weight
//   layers.{i}.layer_scalar
//   layers.{i}.{pli_gate,pli_proj}.*, layers.{i}.pli_norm.weight     per-layer inputs
//   layers.{i}.router.*           router.proj               } with the
//   layers.{i}.router_scale       router.scale              } MoE block
//   layers.{i}.per_expert_scale   router.per_expert_scale   }
//   layers.{i}.experts.{gate,up,down}.*   (experts, out, in), gather_mm / gather_qmm
//   layers.{i}.{mlp_norm_2,post_mlp_norm_1,post_mlp_norm_2}.weight
#pragma once

#include <optional>
#include <vector>

#include "graph.h"

namespace mlx_infer {

struct Gemma4Layer {
  Linear q, k, v, o, gate, up, down;
  std::optional<mx::array> attn_norm, post_attn_norm, mlp_norm, post_mlp_norm, q_norm, k_norm;
  std::optional<mx::array> layer_scalar;
  Linear pli_gate, pli_proj;
  std::optional<mx::array> pli_norm;
  Linear router, expert_gate, expert_up, expert_down;
  std::optional<mx::array> router_scale;  // router.scale * hidden**-0.5, as the router computes it
  std::optional<mx::array> per_expert_scale, mlp_norm_2, post_mlp_norm_1, post_mlp_norm_2;
  int kv_heads = 0;
  int head_dim = 0;
  int window = 0;
  bool owns_kv = true;
  int buffer = 0;  // index of the K/V buffer pair it writes (owner) or reads (donor's)
  RopeSpec rope;
};

struct Gemma4Weights {
  Linear embed_per_layer, per_layer_proj;
  std::optional<mx::array> per_layer_proj_norm;
  std::vector<Gemma4Layer> layers;
  int buffers = 0;  // KV-owning layers
};

/// Reads a gemma4 graph's weights (embed, lm_head, norm into ``g``; the rest into ``g.gemma4``).
void load_gemma4_weights(
    DecodeStep::Graph& g,
    const std::unordered_map<std::string, mx::array>& weights,
    const std::unordered_map<std::string, QuantSpec>& quantization);

/// The gemma4 one-token forward over any KV storage: logits (B, vocab), lazily. ``kv`` is
/// indexed by buffer (KV-owning layer, in order); a KV-shared layer attends over what its
/// donor's ``write_read`` returned in the same forward. With ``logit_rows`` (M,) int32 only
/// those rows' logits (M, vocab).
mx::array gemma4_layers(
    const DecodeStep::Graph& g,
    const mx::array& tokens,
    const mx::array& positions,
    KVAccess& kv,
    const std::optional<mx::array>& logit_rows = std::nullopt);

}  // namespace mlx_infer
