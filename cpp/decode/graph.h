// Internal to cpp/decode/: the weights of a decode step and its one-token forward (reading the weights: weights.h).
//
// One forward for every family (forward.cpp); what a family adds is a switch of DecodeConfig and, where it
// has weights, their canonical names (decode.h has the shared ones). Beyond those:
//
//   layers.{i}.sinks                          per-head attention sink logits (gpt_oss)
//   layers.{i}.router.*, layers.{i}.experts.{gate,up,down}.*   routed experts, (experts, out, in)
//   layers.{i}.layer_scalar                   layer_scalars
//   embed_per_layer.*, per_layer_proj.*, per_layer_proj_norm.weight,
//   layers.{i}.{pli_gate,pli_proj}.*, layers.{i}.pli_norm.weight      per_layer_width > 0
//   layers.{i}.{router_scale,per_expert_scale},
//   layers.{i}.{mlp_norm_2,post_mlp_norm_1,post_mlp_norm_2}.weight     moe_beside_mlp
//   KV-shared layers (kv_donors) have no k, v, k_norm; v_from_k layers no v.
//   layers.{i}.router.correction_bias          noaux_tc: the selection-only score bias (E,)
//   layers.{i}.shared.{gate,up,down}.*         shared experts, added to the routed ones (deepseek_v3)
//   Multi-head latent attention (kv_lora_rank > 0; mla.cpp), instead of q, k, v:
//   layers.{i}.q.* (no q LoRA) or layers.{i}.q_a.*, q_a_norm.weight, q_b.*   the queries
//   layers.{i}.kv_a.*, layers.{i}.kv_a_norm.weight   the latent | RoPE key projection and the latent's norm
//   layers.{i}.embed_q.*, layers.{i}.unembed_out.*   per-head (H, R, nope) and (H, v_head, R) matrices
//                                                    (plain, or affine-quantized as QuantizedMultiLinear)
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "mlx_infer/decode.h"

namespace mlx_infer {

/// A dense or affine-quantized linear (``y = x W^T (+ bias)``).
struct Linear {
  std::optional<mx::array> w;
  // w's transpose (in, out), a view of w's buffer evaluated once at load (weights.cpp: pretranspose): a dense
  // product then reads it as an input instead of adding a Transpose node to every step's graph.
  std::optional<mx::array> wt;
  std::optional<mx::array> scales;  // set when quantized
  std::optional<mx::array> biases;  // quantization biases
  std::optional<mx::array> bias;    // the layer's additive bias
  int group_size = 0;
  int bits = 0;
  std::string mode = "affine";
  bool fast = false;  // product on mlx-infer's CPU kernels (mlx_infer/matmul.h), as the model's layer
  bool tuned = false;  // dense product through tuned_linear (cuBLASLt, tuned per shape; DecodeConfig::tuned_products)
  std::string name;   // canonical name (``layers.3.q``): what adapters target
  // A fused form (q|k|v, gate|up): its linears' canonical names and output features, in output
  // order. Adapters target these members; apply_linear adds each member's update to its rows.
  std::vector<std::pair<std::string, int>> members;

  bool present() const { return w.has_value(); }
  bool quantized() const { return scales.has_value(); }
};

struct LayerWeights {
  Linear q, k, v, o, gate, up, down;
  Linear qkv, gate_up;  // fused forms (handed over fused, or DecodeConfig::fuse_projections): members set
  Linear router, expert_gate, expert_up, expert_down;  // a MoE layer: instead of (or beside) gate/up/down
  std::optional<mx::array> attn_norm, mlp_norm, post_attn_norm, post_mlp_norm, q_norm, k_norm;
  std::optional<mx::array> sinks;  // (H,) attention sink logits (gpt_oss)
  // moe_beside_mlp: router.scale * hidden**-0.5 (as the router computes it), the per-expert output scales, and
  // the experts' own norms
  std::optional<mx::array> router_scale, per_expert_scale, mlp_norm_2, post_mlp_norm_1, post_mlp_norm_2;
  std::optional<mx::array> layer_scalar;  // layer_scalars
  Linear pli_gate, pli_proj;              // per-layer inputs (per_layer_width > 0)
  std::optional<mx::array> pli_norm;
  std::optional<mx::array> router_bias;         // noaux_tc: the correction bias (E,), for the selection only
  Linear shared_gate, shared_up, shared_down;   // shared experts beside the routed ones (deepseek_v3)
  // Multi-head latent attention (cfg.kv_lora_rank > 0): q (no q LoRA) or q_a -> q_a_norm -> q_b; kv_a -> the
  // latent (normed by kv_a_norm) | the RoPE key; per-head embed_q (H, R, nope) and unembed_out (H, v_head, R).
  Linear q_a, q_b, kv_a, embed_q, unembed_out;
  std::optional<mx::array> q_a_norm, kv_a_norm;
  int kv_heads = 0;
  int head_dim = 0;
  int value_dim = 0;  // V's width: head_dim, or MLA's RoPE key width
  int window = 0;
  bool owns_kv = true;  // false: a KV-shared layer, reading its donor's buffer
  bool shared = false;  // an owner whose buffer a later layer reads (its attention is the gather path's)
  int buffer = 0;       // index of the K/V buffer pair it writes (owner) or reads (donor's)
  RopeSpec rope;
};

struct LoraLayout;  // lora.h

struct DecodeStep::Graph {
  DecodeConfig cfg;
  Linear embed;
  Linear lm_head;  // absent (w unset) when the head is tied to the embedding
  std::optional<mx::array> norm;
  std::vector<LayerWeights> layers;
  std::vector<int> buffer_layer;  // per K/V buffer, the layer that owns it
  Linear embed_per_layer, per_layer_proj;  // per-layer inputs (per_layer_width > 0)
  std::optional<mx::array> per_layer_proj_norm;
  mx::Dtype dtype = mx::float32;  // activations
  std::optional<mx::distributed::Group> tp;  // set when cfg.tp_backend names a group
  bool fast_attention = false;  // attention / the gated activation on mlx-infer's CPU kernels,
  bool fast_gated = false;      // as the model's swapped modules (cpu_kernel_linears lists them)
  int traces = 0;
};

/// How attention reads the buffers in one forward.
struct AttentionRead {
  /// Set when every row writes the same slot and reads the same length (per
  /// window group) and the graph is not traced for reuse: per group the
  /// static (slot, read length); the write is a static slice update and
  /// attention reads ``[:length]`` views with no mask (what lets a GPU use its
  /// fused decode-attention kernel).
  std::optional<std::vector<std::pair<int, int>>> uniform;
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
struct QkNorm;  // qkv_rope_cuda.h: the per-head q/k norms qkv_rope applies

class KVAccess {
 public:
  virtual ~KVAccess() = default;
  /// Writes layer ``layer``'s new ``k``, ``v`` (B, KVH, 1, D), RoPE applied, and
  /// returns what its attention reads.
  virtual AttentionInputs write_read(int layer, const mx::array& k, const mx::array& v) = 0;
  /// Writes layer ``layer``'s new ``k``, ``v`` (B, KVH, D), (B, KVH, 1, D) or (B KVH, 1, 1, 1, D) and
  /// attends ``q`` (B, H, D) in one (an attention kernel that reads the storage
  /// itself): (B, H D), or none, having written nothing, to have the layer call
  /// write_read and SDPA.
  virtual std::optional<mx::array> write_attend(int layer, const mx::array& q, const mx::array& k,
                                                const mx::array& v) {
    return std::nullopt;
  }
  /// Whether a fused q|k|v product's output may be split and rotated by one kernel (qkv_rope, CUDA):
  /// its q, k, v then arrive contiguous. The paged step's; the plain step keeps MLX's RoPE.
  virtual bool fused_qkv_rope() const { return false; }
  /// Where fused_qkv_rope applies to ``qkv`` (B, (H + 2 KVH) D): layer ``layer``'s q rotated, its k and v
  /// written into the storage by that same kernel (qkv_rope_write), and q attended over it: (B, H D); or none,
  /// having written nothing, to have the layer call qkv_rope and write_attend. ``norm``: q and k RMS-normed
  /// per head first (qkv_rope's).
  virtual std::optional<mx::array> rope_write_attend(int layer, const mx::array& qkv, int H, int KVH, int D,
                                                     const RopeSpec& rope, const mx::array& positions,
                                                     const QkNorm* norm) {
    return std::nullopt;
  }
};

/// The one-token forward over any KV storage (forward.cpp): logits (B, vocab), lazily. ``kv`` is indexed
/// by buffer (KV-owning layer, in order); a KV-shared layer attends over what its donor's ``write_read``
/// returned in the same forward. With ``logit_rows`` (M,) int32 only those rows' logits (M, vocab), the
/// head run on them alone. ``call_ends`` (B,) int32: each row's call end, which picks a LongRoPE layer's
/// table (a prefill chunk's rows share their chunk's end); none: ``positions + 1``, every row a call of its own.
mx::array layers_forward(
    const DecodeStep::Graph& g,
    const mx::array& tokens,
    const mx::array& positions,
    KVAccess& kv,
    const std::optional<mx::array>& logit_rows = std::nullopt,
    const std::optional<mx::array>& call_ends = std::nullopt);

/// One K/V buffer (KV-owning layer): its heads, K and V widths and window (0 = global).
struct BufferGeometry {
  int kv_heads;
  int head_dim;   // K's width
  int value_dim;  // V's width (head_dim, except under multi-head latent attention)
  int window;
};

/// K/V buffer pairs the forward writes (the KV-owning layers; all layers but the KV-shared ones).
int num_buffers(const DecodeStep::Graph& g);
/// Per buffer, in order (needs the graph's weights loaded).
std::vector<BufferGeometry> buffer_geometry(const DecodeStep::Graph& g);
std::vector<int> buffer_windows(const DecodeStep::Graph& g);

/// Window groups of the KV-owning layers: the distinct windows, ascending (0 = global), and
/// per buffer (KV-owning layer, in order) its group's index.
std::pair<std::vector<int>, std::vector<int>> window_groups(const DecodeStep::Graph& g);

/// The one-token forward over the caller's buffers (DecodeStep::step).
///
/// inputs:  tokens (B,), positions (B,) int32, slots (B, G) int32, reads (B, G)
///          int32 (G window groups, see window_groups), then K and V of each
///          KV-owning layer in order (kv_layers): k_0, v_0, k_1, v_1, ...
///          then, with adapters, ``lora->count`` arrays (slots (B,), then the layout's; lora.h)
/// outputs: logits (B, vocab), k_0', v_0', ...
std::vector<mx::array> decode_forward(
    const DecodeStep::Graph& g,
    const std::vector<mx::array>& inputs,
    const AttentionRead& read,
    const LoraLayout* lora = nullptr);

/// Raises std::invalid_argument naming the first field of ``c`` that is out of range.
void validate_decode_config(const DecodeConfig& c);

// -- building blocks shared by the families' forwards (graph.cpp) --

mx::array scalar(double v, mx::Dtype dtype);
/// nn.Linear / nn.QuantizedLinear (and their CPU-kernel twins), plus the active adapters'
/// update when a LoraScope targets ``l`` (lora.h).
mx::array apply_linear(const Linear& l, const mx::array& x);
/// The layer's own product, no adapter.
mx::array base_linear(const Linear& l, const mx::array& x);
/// x @ w.T (+ bias), dense: over ``l.wt`` where the load made it, else dense_linear (matmul.h).
mx::array transposed_product(const Linear& l, const mx::array& x);
/// nn.Embedding / nn.QuantizedEmbedding lookup: ids (...) -> (..., width).
mx::array embed_lookup(const Linear& e, const mx::array& ids);
/// Embedding.as_linear (the tied head).
mx::array embed_as_linear(const Linear& e, const mx::array& x);
/// Tensor parallel: all_sum over the group of a row-parallel product (identity in one process).
mx::array tp_sum(const DecodeStep::Graph& g, const mx::array& x);
/// embed_lookup, vocabulary-parallel when cfg.vocab_parallel (masked local rows from ``start``, all_sum).
mx::array tp_embed_lookup(const DecodeStep::Graph& g, const Linear& e, const mx::array& ids, int start);
/// Local logits (..., V/N) gathered into (..., V) when cfg.vocab_parallel.
mx::array tp_gather_logits(const DecodeStep::Graph& g, const mx::array& logits);
/// Joins cfg.tp_backend's group (already initialised by Python) into g.tp.
void init_tensor_parallel(DecodeStep::Graph& g);
mx::array rms(const mx::array& x, const std::optional<mx::array>& w, float eps);
/// mx::fast::rope at per-row offsets (B,). A LongRoPE spec (long_freqs) needs ``call_ends`` (B,): each row's
/// call end (one past the last position of the call its token belongs to), which picks its table.
mx::array rope(const mx::array& x, const RopeSpec& r, const mx::array& offset,
               const std::optional<mx::array>& call_ends = std::nullopt);
/// act(gate) * up, shapeless-compiled as mlx-lm compiles its activations.
mx::array gated(const DecodeConfig& cfg, const mx::array& gate, const mx::array& up);
/// SwitchLinear / QuantizedSwitchLinear over the rows' expert ids (moe.cpp).
mx::array switch_linear(const Linear& l, const mx::array& x, const mx::array& idx, bool sorted);
/// The router of layer ``lw``: each row's top-k expert ids and their weights, each (B, 1, k), from the
/// pre-MLP input ``x`` (or, moe_beside_mlp, the residual stream ``h``) (moe.cpp). noaux_tc's weights are float32.
std::pair<mx::array, mx::array> route_experts(const DecodeConfig& cfg, const LayerWeights& lw, const mx::array& x,
                                              const mx::array& h);
/// SwitchGLU over each row's top-k experts, then the routing-weighted sum: x (B, 1, D), indices and
/// weights (B, 1, k) -> (B, 1, D). Expert parallel (a sharded graph): this rank's experts only
/// (cfg.expert_start on), the others' weights zero; the caller all_sums the ranks' shares (moe.cpp).
mx::array switch_glu(const DecodeConfig& cfg, const Linear& gate, const Linear& up, const Linear& down,
                     const mx::array& x, const mx::array& indices, const mx::array& weights, bool expert_parallel);
/// Attention of q (B, H, 1, D) over what a layer's K/V access returned, at cfg.attn_scale: composed of MLX ops
/// with the scores soft-capped when cfg.attn_softcap > 0 (as gemma2's eager attention), else MLX's SDPA (with
/// ``sinks`` (H,): MLX's, as gpt_oss's eager attention), on mlx-infer's CPU kernel when the model's attention
/// modules run there (g.fast_attention) and there are no sinks.
mx::array attend(const DecodeStep::Graph& g, const mx::array& q, const AttentionInputs& in,
                 const std::optional<mx::array>& sinks = std::nullopt);
/// Multi-head latent attention of layer ``lw`` (mla.cpp): x (B, E) the normed input -> (B, H v_head),
/// before o. Writes the latent as K and the RoPE key as V through ``kv`` (write_read: the gather path on every
/// backend) and attends in the absorbed form, as models/deepseek_v3.py's Attention does for one query.
mx::array mla_attention(const DecodeStep::Graph& g, const LayerWeights& lw, const mx::array& x,
                        const mx::array& positions, KVAccess& kv);
/// MultiLinear / QuantizedMultiLinear (models/deepseek_v3.py): x (..., H, L, in) times each head's (out, in)
/// matrix transposed -> (..., H, L, out).
mx::array multi_linear(const Linear& l, const mx::array& x);
/// The shared experts' SwiGLU MLP (deepseek_v3): down(silu(gate(x)) * up(x)).
mx::array shared_experts(const DecodeStep::Graph& g, const LayerWeights& lw, const mx::array& x);

/// Writes one token per row into a (B, KVH, S, D) buffer at slot[b] (or at static_slot).
mx::array write_slot(const mx::array& buf, const mx::array& x, const mx::array& slot,
                     std::optional<int> static_slot);

}  // namespace mlx_infer
