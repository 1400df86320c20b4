// The one-token forward of every family with a compiled step, composed of the same MLX ops, in the same
// order, as the family's model file (python/mlx_infer/models/*.py), so the compiled step's logits stay
// within rounding of the eager graph's. What a family adds is a switch of DecodeConfig or a weight it has
// (graph.h lists them): pre- or post-norms, sandwich norms, q/k norms per head or over the projection,
// fused q|k|v and gate|up, NoPE layers, sinks, soft caps, routed experts instead of (or beside) the MLP,
// per-layer KV geometry and KV sharing, per-layer inputs, layer scalars, granite's multipliers; DeepSeek V3's
// multi-head latent attention instead of grouped-query attention (mla.cpp), its noaux_tc routing and shared
// experts (moe.cpp).
//
// The K/V storage is a KVAccess: DecodeStep's buffers (graph.cpp) or a paged store's pages
// (paged_step.cpp). KV-shared layers read what their donor's write_read returned earlier in the same step.
#include "graph.h"

#include "../attention/qkv_rope_cuda.h"
#include "../fused/fused_cuda.h"
#include "mlx_infer/matmul.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace mlx_infer {

namespace {

// gemma3.residual_add: in float16, summed in float32 and clipped to the f16 range.
mx::array residual(const DecodeConfig& cfg, const mx::array& x, const mx::array& y) {
  if (!cfg.clip_f16_residual || x.dtype() != mx::float16) {
    return mx::add(x, y);
  }
  float bound = 65504.0f;
  auto s = mx::add(mx::astype(x, mx::float32), mx::astype(y, mx::float32));
  return mx::astype(mx::clip(s, mx::array(-bound), mx::array(bound)), mx::float16);
}

// h + norm(r): the sandwich norm's residual where the layer has one (gemma), else h + r.
mx::array add_residual(const DecodeConfig& cfg, const mx::array& h, const mx::array& r,
                       const std::optional<mx::array>& post_norm) {
  return post_norm ? residual(cfg, h, rms(r, post_norm, cfg.rms_norm_eps)) : mx::add(h, r);
}

// Whether residual_then_norm takes one CUDA kernel (fused_cuda.h): switched on, a step of at most
// fused_norm_max_rows() rows (a prompt chunk's takes MLX's ops: fused_cuda.h says why), and a norm after the residual
// (the residual a plain add, or a sandwich norm's: gemma's rms(r, post_norm) added, clipped in float16).
bool add_norm_fuses(const mx::array& h, const mx::array& r, const std::optional<mx::array>& post_norm,
                    const std::optional<mx::array>& next_norm) {
  return next_norm && fused_add_norm_enabled() && h.shape(0) <= fused_norm_max_rows() &&
         add_rms_norm_applies(h, r, *next_norm, post_norm ? &*post_norm : nullptr);
}

// The residual and the norm of the block after it: (h', next_norm ? rms(h', next_norm) : h') with h' =
// add_residual(h, r, post_norm); one kernel where add_norm_fuses, MLX's ops otherwise.
std::pair<mx::array, mx::array> residual_then_norm(const DecodeConfig& cfg, const mx::array& h, const mx::array& r,
                                                   const std::optional<mx::array>& post_norm,
                                                   const std::optional<mx::array>& next_norm) {
  if (add_norm_fuses(h, r, post_norm, next_norm)) {
    return add_rms_norm(h, r, *next_norm, cfg.rms_norm_eps, post_norm ? &*post_norm : nullptr,
                        cfg.clip_f16_residual);  // (B, E) each
  }
  auto sum = add_residual(cfg, h, r, post_norm);
  return {sum, next_norm ? rms(sum, next_norm, cfg.rms_norm_eps) : sum};
}

// nn.gelu_approx(x) alone (shapeless-compiled as MLX compiles it): the per-layer-input gate
// multiplies after it, outside the fused activation, as the eager layer does.
std::vector<mx::array> gelu_approx_ops(const std::vector<mx::array>& in) {
  const auto& x = in[0];
  auto dt = x.dtype();
  auto inner = mx::add(x, mx::multiply(scalar(0.044715, dt), mx::power(x, scalar(3, dt))));
  auto t = mx::tanh(mx::multiply(scalar(0.7978845608028654, dt), inner));  // sqrt(2 / pi)
  return {mx::multiply(mx::multiply(scalar(0.5, dt), x), mx::add(scalar(1, dt), t))};
}

mx::array gelu_approx(const mx::array& x) {
  static auto fn = mx::compile(gelu_approx_ops, /*shapeless=*/true);
  return fn({x})[0];
}

// The per-layer inputs (gemma4): (B, 1, L, P), the token-identity part plus a projection of the embeddings
// h (B, E).
mx::array per_layer_inputs(const DecodeStep::Graph& g, const mx::array& ids, const mx::array& h) {
  const auto& cfg = g.cfg;
  const int B = ids.shape(0), L = cfg.num_layers, P = cfg.per_layer_width;
  auto t = tp_embed_lookup(g, g.embed_per_layer, ids, cfg.per_layer_vocab_start);  // (B, 1, L*P)
  t = mx::reshape(mx::multiply(t, scalar(std::sqrt(static_cast<double>(P)), t.dtype())), {B, 1, L, P});
  auto proj = apply_linear(g.per_layer_proj, h);  // (B, L*P)
  proj = mx::multiply(proj, scalar(std::pow(static_cast<double>(cfg.hidden_size), -0.5), proj.dtype()));
  proj = rms(mx::reshape(proj, {B, 1, L, P}), g.per_layer_proj_norm, cfg.rms_norm_eps);
  auto sum = mx::add(proj, t);
  return mx::multiply(sum, scalar(std::pow(2.0, -0.5), sum.dtype()));
}

// The dense gated MLP: down(act(gate(x)) * up(x)), all heads' shares summed under tensor parallel.
mx::array dense_mlp(const DecodeStep::Graph& g, const LayerWeights& lw, const mx::array& x) {
  mx::array gate(0), up(0);
  if (lw.gate_up.present()) {
    auto gate_up = apply_linear(lw.gate_up, x);  // (B, 2F)
    if (!g.fast_gated && fused_gated_enabled() && gated_activation_applies(gate_up, g.cfg.activation)) {
      return tp_sum(g, apply_linear(lw.down, gated_activation(gate_up, g.cfg.activation)));
    }
    auto parts = mx::split(gate_up, 2, -1);
    gate = parts[0], up = parts[1];
  } else {
    gate = apply_linear(lw.gate, x);
    up = apply_linear(lw.up, x);
  }
  auto act = g.fast_gated
      ? fast_gated_activation(gate, up, g.cfg.activation == "gelu_tanh" ? "gelu_approx" : "silu")
      : gated(g.cfg, gate, up);
  return tp_sum(g, apply_linear(lw.down, act));
}

// The block after attention, before its residual: h (B, E) and x = its mlp_norm (or h) -> mlp(x) (the dense
// MLP, the routed experts instead of it, or both), times the residual scale. The routed experts' code (moe.cpp)
// keeps the eager layer's (B, 1, E) shapes.
mx::array mlp_branch(const DecodeStep::Graph& g, const LayerWeights& lw, const mx::array& h, const mx::array& x) {
  const auto& cfg = g.cfg;
  const float eps = cfg.rms_norm_eps;
  const int B = h.shape(0), E = h.shape(-1);
  mx::array r(0);
  if (!lw.router.present()) {
    r = dense_mlp(g, lw, x);
  } else if (!cfg.moe_beside_mlp) {  // qwen3_moe's SparseMoeBlock, gpt_oss's MLPBlock, deepseek_v3's MoE
    auto x3 = mx::reshape(x, {B, 1, E});
    auto [idx, scores] = route_experts(cfg, lw, x3, x3);
    r = mx::reshape(mx::astype(switch_glu(cfg, lw.expert_gate, lw.expert_up, lw.expert_down, x3, idx, scores,
                                          false),
                               x.dtype()),
                    {B, E});
    if (lw.shared_gate.present()) {  // deepseek_v3: the shared experts' MLP added
      r = mx::add(r, shared_experts(g, lw, x));
    }
  } else {  // gemma4: the dense MLP and the experts side by side, each normed, then summed
    auto h1 = rms(dense_mlp(g, lw, x), lw.post_mlp_norm_1, eps);
    auto h3 = mx::reshape(h, {B, 1, E});
    auto [idx, scores] = route_experts(cfg, lw, mx::reshape(x, {B, 1, E}), h3);
    // Expert parallel: this rank holds some of the experts (cfg.expert_start on); the ranks' shares summed.
    const bool parallel = g.tp.has_value() && lw.expert_gate.w->shape(0) < cfg.num_experts;
    auto h2 = tp_sum(g, switch_glu(cfg, lw.expert_gate, lw.expert_up, lw.expert_down, rms(h3, lw.mlp_norm_2, eps),
                                   idx, scores, parallel));
    r = mx::add(h1, rms(mx::reshape(h2, {B, E}), lw.post_mlp_norm_2, eps));
  }
  if (cfg.residual_scale != 1.0f) {
    r = mx::multiply(r, scalar(cfg.residual_scale, r.dtype()));
  }
  return r;  // (B, E)
}

// Grouped-query attention of layer i (every family but MLA's): x (B, E) the normed input -> (B, H D), before
// o. ``reads``: per buffer, what a KV-owning layer's write_read returned this step (KV-shared layers attend
// over their donor's). ``call_ends`` (B,): each row's call end (LongRoPE's table), set when some layer has
// LongRoPE. The fused path (qkv_rope, then an attention kernel over the storage) keeps every array in the
// (rows, heads, D) form its kernels read: no view between them.
mx::array gqa_attention(const DecodeStep::Graph& g, int i, const mx::array& x, const mx::array& positions,
                        const std::optional<mx::array>& call_ends, KVAccess& kv,
                        std::vector<std::optional<AttentionInputs>>& reads) {
  const auto& cfg = g.cfg;
  const auto& lw = g.layers[i];
  const int B = x.shape(0), H = cfg.num_heads, KVH = lw.kv_heads, D = lw.head_dim;
  const float eps = cfg.rms_norm_eps;
  const bool attends_itself = lw.owns_kv && !lw.shared;  // may take write_attend's kernel
  mx::array q(0), k(0), v(0);
  bool rotated = false;  // q and k already rotated (qkv_rope)
  if (lw.qkv.present()) {
    auto qkv = apply_linear(lw.qkv, x);  // (B, (H + 2 KVH) D)
    if (lw.o.present() && l2_prefetch_o_enabled() && l2_prefetch_applies(qkv, *lw.o.w)) {
      qkv = l2_prefetch(qkv, *lw.o.w);  // o's weight streams into the L2 while RoPE, K/V writes, attention run
    }
    // per-head q/k norms (gemma3, qwen3) go inside the kernel on steps of at most fused_norm_max_rows() rows;
    // norms over the whole projection or of v do not
    std::optional<QkNorm> qk;
    if (lw.q_norm && lw.k_norm && !cfg.qk_norm_whole && qkv_rope_norm_enabled() && B <= fused_norm_max_rows()) {
      qk = QkNorm{*lw.q_norm, *lw.k_norm, eps};
    }
    const QkNorm* norm = qk ? &*qk : nullptr;
    if ((!lw.q_norm || qk) && !cfg.v_norm && kv.fused_qkv_rope() &&
        qkv_rope_supported(qkv, H, KVH, D, lw.rope, norm)) {
      if (attends_itself) {
        if (auto out = kv.rope_write_attend(lw.buffer, qkv, H, KVH, D, lw.rope, positions, norm)) {
          return *out;  // (B, H D)
        }
      }
      // q (B, H, D); k, v contiguous, where this layer writes them itself in the Scatter's update layout
      auto [qr, kr, vr] = qkv_rope(qkv, H, KVH, D, lw.rope, positions, attends_itself, norm);
      if (attends_itself) {
        if (auto out = kv.write_attend(lw.buffer, qr, kr, vr)) {
          return mx::reshape(*out, {B, H * D});  // (B, H D)
        }
      }
      q = mx::reshape(qr, {B, H, 1, D});
      k = mx::reshape(kr, {B, KVH, 1, D});
      v = mx::reshape(vr, {B, KVH, 1, D});
      rotated = true;
    } else {
      auto parts = mx::split(qkv, mx::Shape{H * D, (H + KVH) * D}, -1);
      q = parts[0], k = parts[1], v = parts[2];
    }
  } else {
    q = apply_linear(lw.q, x);  // (B, H D)
    if (lw.owns_kv) {
      k = apply_linear(lw.k, x);
      v = lw.v.present() ? apply_linear(lw.v, x) : k;  // v_from_k: V is K's projection
    }
  }
  if (!rotated) {
    if (lw.q_norm && cfg.qk_norm_whole) {  // olmo2: over all heads at once, before they split
      q = rms(q, lw.q_norm, eps);
      if (lw.owns_kv) k = rms(k, lw.k_norm, eps);
    }
    q = mx::reshape(q, {B, 1, H, D});
    if (lw.q_norm && !cfg.qk_norm_whole) q = rms(q, lw.q_norm, eps);
    q = rope(mx::transpose(q, {0, 2, 1, 3}), lw.rope, positions, call_ends);  // (B, H, 1, D)
    if (lw.owns_kv) {
      k = mx::reshape(k, {B, 1, KVH, D});
      v = mx::reshape(v, {B, 1, KVH, D});
      if (lw.k_norm && !cfg.qk_norm_whole) k = rms(k, lw.k_norm, eps);
      if (cfg.v_norm) v = rms(v, std::nullopt, eps);
      k = rope(mx::transpose(k, {0, 2, 1, 3}), lw.rope, positions, call_ends);  // (B, KVH, 1, D)
      v = mx::transpose(v, {0, 2, 1, 3});
    }
    if (attends_itself) {
      if (auto out = kv.write_attend(lw.buffer, mx::reshape(q, {B, H, D}), k, v)) {
        return mx::reshape(*out, {B, H * D});  // (B, H D)
      }
    }
  }

  if (lw.owns_kv) {
    reads[lw.buffer] = kv.write_read(lw.buffer, k, v);
  } else if (!reads[lw.buffer]) {
    throw std::invalid_argument("[DecodeStep] layer " + std::to_string(i) +
                                " reads K/V no earlier layer wrote in this step.");
  }
  auto attn = attend(g, q, *reads[lw.buffer], lw.sinks);  // (B, H, 1, D)
  return mx::reshape(mx::transpose(attn, {0, 2, 1, 3}), {B, H * D});  // (B, H D)
}

}  // namespace

mx::array layers_forward(
    const DecodeStep::Graph& g,
    const mx::array& tokens,
    const mx::array& positions,  // (B,) int32
    KVAccess& kv,
    const std::optional<mx::array>& logit_rows,
    const std::optional<mx::array>& call_ends) {
  const auto& cfg = g.cfg;
  const int L = cfg.num_layers;
  const int B = tokens.shape(0);
  const float eps = cfg.rms_norm_eps;
  if (static_cast<int>(g.layers.size()) != L) {
    throw std::invalid_argument("[DecodeStep] the forward has weights for " + std::to_string(g.layers.size()) +
                                " of " + std::to_string(L) + " layers.");
  }

  // LongRoPE picks each row's table by its call's end: the caller's (a prefill chunk's rows share their
  // chunk's), else positions + 1 (every row a one-token call).
  std::optional<mx::array> ends;  // (B,) int32
  for (const auto& lw : g.layers) {
    if (lw.rope.long_freqs) {
      ends = call_ends ? *call_ends : mx::add(positions, mx::array(1, positions.dtype()));
      break;
    }
  }

  // The hidden state is (B, E) throughout: a product of 2-D rows needs no flatten / unflatten around it.
  auto h = tp_embed_lookup(g, g.embed, mx::reshape(tokens, {B}), cfg.vocab_start);  // (B, E)
  if (cfg.embed_scale != 0.0f) {
    h = mx::multiply(h, scalar(cfg.embed_scale, h.dtype()));
  }
  std::optional<mx::array> pli;  // (B, 1, L, P)
  if (cfg.per_layer_width > 0) {
    pli = per_layer_inputs(g, mx::reshape(tokens, {B, 1}), h);
  }

  // Each residual add and the norm after it go together (residual_then_norm): x is the next block's input.
  // After the last layer the final norm joins the add only where they fuse (it then runs on all B rows, before
  // the logit rows are taken); otherwise the rows are taken first, as before.
  std::vector<std::optional<AttentionInputs>> reads(num_buffers(g));  // a shared buffer's, after its write
  auto x = g.layers.empty() || !g.layers[0].attn_norm ? h : rms(h, g.layers[0].attn_norm, eps);  // (B, E)
  std::optional<mx::array> normed;  // the final norm of h's B rows, where it fused with the last add
  for (int i = 0; i < L; ++i) {
    const auto& lw = g.layers[i];

    auto o = cfg.kv_lora_rank > 0 ? mla_attention(g, lw, x, positions, kv)        // (B, H v_head)
                                  : gqa_attention(g, i, x, positions, ends, kv, reads);  // (B, H D)
    auto r = tp_sum(g, apply_linear(lw.o, o));  // (B, E): all heads' sum under tensor parallel
    if (cfg.residual_scale != 1.0f) {
      r = mx::multiply(r, scalar(cfg.residual_scale, r.dtype()));
    }
    std::tie(h, x) = residual_then_norm(cfg, h, r, lw.post_attn_norm, lw.mlp_norm);  // x: the MLP's input

    // Per-layer inputs and layer scalars change h after the MLP's residual: the next norm waits for them.
    const bool tail = pli.has_value() || lw.layer_scalar.has_value();
    const bool last = i + 1 == L;
    std::optional<mx::array> next_norm;  // olmo2: no pre-norm
    if (!tail && !last) {
      next_norm = g.layers[i + 1].attn_norm;
    } else if (!tail && add_norm_fuses(h, h, lw.post_mlp_norm, g.norm)) {
      next_norm = g.norm;
    }
    std::tie(h, x) = residual_then_norm(cfg, h, mlp_branch(g, lw, h, x), lw.post_mlp_norm, next_norm);
    if (last && next_norm) {
      normed = x;
    }

    if (pli) {
      auto mine = mx::reshape(mx::slice(*pli, {0, 0, i, 0}, {B, 1, i + 1, cfg.per_layer_width}),
                              {B, cfg.per_layer_width});  // (B, P)
      auto gate = mx::multiply(gelu_approx(apply_linear(lw.pli_gate, h)), mine);  // (B, P)
      h = mx::add(h, rms(apply_linear(lw.pli_proj, gate), lw.pli_norm, eps));
    }
    if (lw.layer_scalar) {
      h = mx::multiply(h, *lw.layer_scalar);
    }
    if (tail && !last) {
      x = g.layers[i + 1].attn_norm ? rms(h, g.layers[i + 1].attn_norm, eps) : h;
    }
  }

  if (normed) {
    h = logit_rows ? mx::take(*normed, *logit_rows, 0) : *normed;  // (M, E)
  } else {
    if (logit_rows) {
      h = mx::take(h, *logit_rows, 0);  // (M, E): the head runs on these rows only
    }
    h = rms(h, g.norm, eps);
  }
  auto logits = g.lm_head.present() ? apply_linear(g.lm_head, h) : embed_as_linear(g.embed, h);
  logits = tp_gather_logits(g, logits);  // (B or M, vocab)
  if (cfg.logits_divisor != 1.0f) {
    logits = mx::divide(logits, scalar(cfg.logits_divisor, logits.dtype()));
  }
  if (cfg.final_logit_softcap) {
    auto cap = scalar(*cfg.final_logit_softcap, logits.dtype());
    logits = mx::multiply(mx::tanh(mx::divide(logits, cap)), cap);
  }
  return mx::reshape(logits, {h.shape(0), logits.shape(-1)});  // (B or M, vocab)
}

}  // namespace mlx_infer
