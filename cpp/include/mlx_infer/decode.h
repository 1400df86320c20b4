// The compiled one-token decode step (DESIGN.md, "Contracts": DecodeStep).
//
// One step feeds one new token for each of B sequences through a decoder
// graph (one forward for every family, cpp/decode/forward.cpp, its switches
// in DecodeConfig) and returns the next-token logits. The step
// is pure: (tokens, positions, write slots, read lengths, K/V) -> (logits,
// K/V'); the caller owns the KV (python/mlx_infer/state/kv.py, mlx-lm's
// layout) and holds the returned arrays in place of the ones it passed:
//
//   per KV-owning layer, K and V buffers (B, kv_heads_i, S_i, head_dim_i)
//     (every layer owns one, except KV-shared layers (kv_donors: gemma4's),
//     which read their donor's buffers after the donor's write; kv_heads_i /
//     head_dim_i are the layer's own where DecodeConfig::layer_* say so;
//     multi-head latent attention (kv_lora_rank > 0): K (B, 1, S, kv_lora_rank)
//     the latent, V (B, 1, S, qk_rope_head_dim) the RoPE key)
//
//   Buffers are grouped by window (window_groups(): the distinct windows of
//   the KV-owning layers, ascending; 0 = global). Per group g and row b the
//   caller says where the new token goes (slots[g][b]: the position itself on
//   a growing cache, the ring slot on a rotating one) and how many leading
//   slots attention then reads (reads[g][b]: the slots written so far, the new
//   one included). The step writes, reads and returns the buffers; it never
//   grows, trims or reorders them (the cache's rules do, before the call).
//
//   Compiled (B >= compile_min_batch): attention reads the whole buffer under
//   a per-row mask (slot < read length), so the traced graph depends on the
//   buffer shapes only: per-step integers enter as arrays and a steady-state
//   step never retraces. Otherwise the graph is built op by op each step and,
//   while all rows agree, writes at a static slot and reads [:length] views
//   without a mask.
//
// A call that throws (bad input, capacity limit) builds nothing and returns
// nothing: the caller's buffers are as they were. For MLX to write the new
// token in place the caller must drop its references to the buffers it
// passed before the outputs are evaluated (holding them forces a copy of the
// whole buffer per step).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <mlx/mlx.h>

#include "mlx_infer/lora.h"

namespace mlx_infer {

namespace mx = mlx::core;

/// RoPE of one layer, as ``mx::fast::rope`` takes it (exactly one of base/freqs).
struct RopeSpec {
  int dims = 0;  // 0: the layer applies no RoPE
  bool traditional = false;
  std::optional<float> base;
  float scale = 1.0f;
  std::optional<mx::array> freqs;
  /// YaRN magnitude correction (LongRoPE: its attention_factor) applied to the first ``dims`` features first.
  float mscale = 1.0f;
  /// LongRoPE (Phi-3): with a long table, ``freqs`` is the short one and each row rotates with the long table
  /// when its call ends past ``original`` (the row's call end > original), else with the short one.
  std::optional<mx::array> long_freqs;
  int original = 0;
};

/// The graph a step runs. Weights are handed over separately (see DecodeStep).
struct DecodeConfig {
  std::string family;  // the graph's family, for messages: the switches below say what the forward does
  int num_layers = 0;
  int hidden_size = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int vocab_size = 0;
  float rms_norm_eps = 1e-6f;
  float attn_scale = 1.0f;
  float attn_softcap = 0.0f;        // gemma2: scores = cap * tanh(scores / cap) before the softmax; 0 = none
  std::string activation = "silu";  // "silu" (SwiGLU), "gelu_tanh" (GeGLU) or "swiglu_oai" (gpt_oss's clamped)
  float swiglu_limit = 7.0f;        // swiglu_oai: the gate clipped from above, the linear part to +-limit
  float embed_scale = 0.0f;         // multiply embeddings by this when != 0
  float residual_scale = 1.0f;      // granite: each sublayer's output times this before its residual add
  float logits_divisor = 1.0f;      // granite: the logits over this (its logits_scaling)
  bool pre_norms = true;            // false (olmo2): no norm before attention / the MLP, post-norms only
  bool qk_norm_whole = false;       // olmo2: q/k RMSNorm over the whole projection, before the heads split
  bool norm_topk_prob = false;      // qwen3_moe: the top-k routing weights renormalized to sum to 1
  bool moe_softmax_topk = false;    // gpt_oss: the softmax over the k chosen router logits (else over all)
  bool clip_f16_residual = false;   // gemma3: f16 residual sums in f32, clipped
  std::optional<float> final_logit_softcap;
  std::vector<int> windows;     // per layer: 0 = global, else the sliding window
  std::vector<RopeSpec> ropes;  // per layer
  std::string kv_dtype;         // "bfloat16" | "float16" | "float32" | "" (= the model's dtype); the
                                // caller holds its K/V in it (the step writes in the buffers' dtype)
  int max_capacity = 0;         // 0 = unbounded; a step whose new token would be past it throws
  bool compile = true;          // mx::compile the whole step (masked attention)...
  int compile_min_batch = 2;    // ...for batches of at least this many rows; smaller
                                // batches build the graph per step and, while all rows
                                // hold one length, read exact-length KV views unmasked
                                // (the GPU's fused decode-attention kernel applies)
  bool fuse_projections = false;  // q|k|v and gate|up as one matmul each (costs a weight copy)
  /// Dense bf16/f16 products (not quantized, not on the CPU kernels) through tuned_linear
  /// (mlx_infer/matmul.h: cuBLASLt's fastest algorithm per shape on CUDA; mx::matmul elsewhere).
  bool tuned_products = false;
  /// Linears (``embed`` = the tied head) whose products run on mlx-infer's CPU
  /// kernels (mlx_infer/matmul.h), as the model's own layers do.
  std::vector<std::string> cpu_kernel_linears;

  // Tensor parallel (python/mlx_infer/parallel): the weights are this rank's shard (local
  // num_heads / num_kv_heads / MLP width); o and down are followed by an all_sum over the group.
  std::string tp_backend;       // "" = one process; else the mx::distributed backend of the group
  bool vocab_parallel = false;  // embed / lm_head hold vocabulary rows [vocab_start, +rows):
  int vocab_start = 0;          // lookup = masked local rows + all_sum; logits = all_gather
  int per_layer_vocab_start = 0;  // gemma4: the same for the per-layer input table
  int expert_start = 0;           // gemma4: experts held here are [expert_start, +local); all_sum after

  // Per-layer KV geometry and KV sharing (gemma4); the defaults give every layer its own
  // (num_kv_heads, head_dim) buffer.
  std::vector<int> layer_kv_heads;   // per layer; empty = num_kv_heads everywhere
  std::vector<int> layer_head_dims;  // per layer; empty = head_dim everywhere
  std::vector<int> kv_donors;        // per layer: -1 owns a buffer, j reads layer j's; empty = all own
  std::vector<int> v_from_k;         // per layer: 1 = V is K's projection, no v weights (gemma4's
                                     // attention_k_eq_v); empty = every layer has its own
  bool v_norm = false;               // gemma4: V RMS-normed (no weight) before it is cached
  int per_layer_width = 0;           // per-layer input width (0 = no per-layer inputs: gemma4's)
  bool layer_scalars = false;        // gemma4: each layer's output times its layers.{i}.layer_scalar
  int num_experts = 0;               // MoE layers (those with a router) when > 0...
  int top_k_experts = 0;             // ...routing each token to this many experts
  bool moe_beside_mlp = false;       // gemma4: the experts run beside the dense MLP, with their own norms,
                                     // the router on rms(h) * router_scale and per-expert scales (else
                                     // instead of the MLP: qwen3_moe, gpt_oss)
  // noaux_tc routing (deepseek_v3; cpp/decode/moe.cpp): sigmoid scores in float32 plus a selection-only
  // correction bias (layers.{i}.router.correction_bias), the top k within the best moe_topk_groups of
  // moe_groups expert groups, weights from the uncorrected scores (renormalized with norm_topk_prob when
  // k > 1) times routed_scaling_factor.
  bool moe_noaux_tc = false;
  int moe_groups = 1;                // n_group
  int moe_topk_groups = 1;           // topk_group
  float routed_scaling_factor = 1.0f;

  // Multi-head latent attention (deepseek_v3; cpp/decode/mla.cpp) when kv_lora_rank > 0, in mlx-lm's
  // absorbed form. Each layer's buffers hold one KV head: K the normed latent (kv_lora_rank wide: head_dim
  // must equal it, num_kv_heads 1) and V the rotated RoPE key (qk_rope_head_dim wide); queries are
  // qk_nope_head_dim + qk_rope_head_dim wide per head, outputs v_head_dim. attn_scale includes YaRN's mscale.
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
};

/// KV layout helpers (the per-layer geometry of DecodeConfig).
int layer_kv_heads(const DecodeConfig& c, int layer);
int layer_head_dim(const DecodeConfig& c, int layer);
/// V's width in a layer's buffer: its head_dim, or MLA's qk_rope_head_dim (its K holds the latent).
int layer_value_dim(const DecodeConfig& c, int layer);
/// The layers that own a KV buffer, in order: buffer pair j belongs to layer ``kv_layers(c)[j]``.
std::vector<int> kv_layers(const DecodeConfig& c);

/// Quantization of one linear: (group_size, bits, mode).
using QuantSpec = std::tuple<int, int, std::string>;

struct LoraLayout;  // cpp/decode/lora.h

/// What one DecodeStep::step returns, lazily: the logits and every KV-owning layer's updated buffers.
struct DecodeStepOutput {
  mx::array logits;               // (B, vocab)
  std::vector<mx::array> keys;    // per KV-owning layer (B, kv_heads, S, head_dim)
  std::vector<mx::array> values;  // likewise (MLA: qk_rope_head_dim wide)
};

/// A one-token decode step over K/V the caller owns (see the file comment). Not thread-safe.
class DecodeStep {
 public:
  /// Args:
  ///   config: the graph's shape and switches.
  ///   weights: canonical names (see python/mlx_infer/generation/bindings/decode_step.py):
  ///     embed.{weight,scales,biases}, norm.weight, lm_head.* (absent when tied),
  ///     layers.{i}.{q,k,v,o,gate,up,down}.{weight,bias,scales,biases},
  ///     layers.{i}.{attn_norm,mlp_norm,post_attn_norm,post_mlp_norm,q_norm,k_norm}.weight
  ///     (norm weights already include gemma's ``1 +``); the switches' own names
  ///     are listed in cpp/decode/graph.h.
  ///   quantization: linear name (``embed``, ``lm_head``, ``layers.{i}.q``...) -> spec.
  DecodeStep(
      DecodeConfig config,
      const std::unordered_map<std::string, mx::array>& weights,
      const std::unordered_map<std::string, QuantSpec>& quantization);
  ~DecodeStep();

  /// One new token per row over the caller's K/V; nothing is kept.
  ///
  /// Args:
  ///   tokens: (B,) integer ids.
  ///   positions: B ints, each row's new token's position (the tokens it already holds).
  ///   slots: per window group (window_groups()) B ints, the slot the new token goes to.
  ///   reads: per window group B ints, the leading slots attention reads after the write.
  ///   keys, values: per KV-owning layer (kv_layers) ``(B, kv_heads, S, head_dim)`` (MLA's values:
  ///     ``(B, 1, S, qk_rope_head_dim)``).
  ///   adapter_slots: (B,) each row's bank slot (with adapters set); none: no row has one.
  /// Throws std::invalid_argument on bad input, std::runtime_error past max_capacity.
  DecodeStepOutput step(const mx::array& tokens, const std::vector<int>& positions,
                        const std::vector<std::vector<int>>& slots, const std::vector<std::vector<int>>& reads,
                        const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
                        const std::optional<mx::array>& adapter_slots = std::nullopt);
  /// The adapter bank's stacked tensors (mlx_infer/lora.h), inputs of every later step; empty
  /// inputs remove them. A new set of targets retraces; new values of the same shapes do not.
  void set_adapters(const LoraInputs& adapters);
  /// Targets of the adapters set (canonical linear names).
  std::vector<std::string> adapter_targets() const;
  /// The distinct windows of the KV-owning layers, ascending (0 = global): the groups of step's slots/reads.
  const std::vector<int>& window_groups() const { return groups_; }
  /// Times the whole-step graph was traced (one per input-shape signature seen).
  int traces() const;
  /// Steps built so far.
  int steps() const { return steps_; }
  const DecodeConfig& config() const;

  struct Graph;  // weights and config, shared with the compiled function

 private:
  std::shared_ptr<Graph> graph_;
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> compiled_;
  std::shared_ptr<const LoraLayout> lora_;  // set by set_adapters
  std::vector<mx::array> lora_arrays_;     // its arrays, after the per-step slots
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> compiled_lora_;  // with lora_
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> compile_forward(
      std::shared_ptr<const LoraLayout> lora) const;
  void compile_step();
  std::vector<int> groups_;        // window_groups()
  std::vector<int> buffer_group_;  // per KV-owning layer, its index in groups_
  int steps_ = 0;
};

}  // namespace mlx_infer
