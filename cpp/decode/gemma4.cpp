// The one-token forward of the Gemma 4 text family, composed of the same MLX
// ops, in the same order, as python/mlx_infer/models/gemma4.py (itself mlx-lm's
// gemma4_text), so the compiled step's logits stay within rounding of the
// eager graph's. KV-shared layers read the buffers their donor wrote earlier in
// the same step; only KV-owning layers have buffers (see decode.h). The K/V storage is
// a KVAccess: DecodeStep's buffers or a paged store's pages (paged_step.cpp).
#include "gemma4.h"
#include "weights.h"

#include "mlx_infer/cpu_attention.h"
#include "mlx_infer/matmul.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace mlx_infer {

namespace {

// Router.__call__: (indices, weights), each (B, 1, k).
std::pair<mx::array, mx::array> route(const DecodeConfig& cfg, const Gemma4Layer& lw,
                                      const mx::array& h) {
  const int E = cfg.num_experts, k = cfg.top_k_experts;
  auto scores = apply_linear(lw.router, rms(h, lw.router_scale, cfg.rms_norm_eps));  // (B, 1, E)
  auto part = mx::argpartition(scores, E - k, -1);
  auto stop = part.shape();
  auto idx = mx::slice(part, {0, 0, E - k}, stop);  // (B, 1, k)
  auto weights = mx::softmax(mx::take_along_axis(scores, idx, -1), -1, /*precise=*/false);
  return {idx, mx::multiply(weights, mx::take(*lw.per_expert_scale, idx, 0))};
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

}  // namespace

mx::array gemma4_layers(
    const DecodeStep::Graph& g,
    const mx::array& tokens,
    const mx::array& positions,  // (B,) int32
    KVAccess& kv,
    const std::optional<mx::array>& logit_rows) {
  const auto& cfg = g.cfg;
  const auto& w = *g.gemma4;
  const int L = cfg.num_layers, H = cfg.num_heads, P = cfg.per_layer_width;
  const float eps = cfg.rms_norm_eps;
  const int B = tokens.shape(0);
  auto ids = mx::reshape(tokens, {B, 1});

  auto h = tp_embed_lookup(g, g.embed, ids, cfg.vocab_start);  // (B, 1, E)
  h = mx::multiply(h, scalar(cfg.embed_scale, h.dtype()));

  std::optional<mx::array> pli;  // (B, 1, L, P): token-identity part + projection of the embeddings
  if (P > 0) {
    auto t = tp_embed_lookup(g, w.embed_per_layer, ids, cfg.per_layer_vocab_start);  // (B, 1, L*P)
    t = mx::reshape(mx::multiply(t, scalar(std::sqrt(static_cast<double>(P)), t.dtype())), {B, 1, L, P});
    auto proj = apply_linear(w.per_layer_proj, h);  // (B, 1, L*P)
    proj = mx::multiply(proj, scalar(std::pow(static_cast<double>(cfg.hidden_size), -0.5), proj.dtype()));
    proj = rms(mx::reshape(proj, {B, 1, L, P}), w.per_layer_proj_norm, eps);
    auto sum = mx::add(proj, t);
    pli = mx::multiply(sum, scalar(std::pow(2.0, -0.5), sum.dtype()));
  }

  std::vector<std::optional<AttentionInputs>> reads(w.buffers);  // per buffer, after its owner's write
  for (int i = 0; i < L; ++i) {
    const auto& lw = w.layers[i];
    const int KVH = lw.kv_heads, D = lw.head_dim;
    auto x = rms(h, lw.attn_norm, eps);
    auto q = rms(mx::reshape(apply_linear(lw.q, x), {B, 1, H, D}), lw.q_norm, eps);  // (B, 1, H, D)
    if (lw.owns_kv) {
      auto k = mx::reshape(apply_linear(lw.k, x), {B, 1, KVH, D});
      auto v = lw.v.present() ? mx::reshape(apply_linear(lw.v, x), {B, 1, KVH, D}) : k;
      k = rope(mx::transpose(rms(k, lw.k_norm, eps), {0, 2, 1, 3}), lw.rope, positions);  // (B, KVH, 1, D)
      v = mx::transpose(rms(v, std::nullopt, eps), {0, 2, 1, 3});                       // (B, KVH, 1, D)
      reads[lw.buffer] = kv.write_read(lw.buffer, k, v);
    }
    if (!reads[lw.buffer]) {
      throw std::invalid_argument("[DecodeStep] gemma4 layer " + std::to_string(i) +
                                  " reads K/V no earlier layer wrote in this step.");
    }
    q = rope(mx::transpose(q, {0, 2, 1, 3}), lw.rope, positions);  // (B, H, 1, D)
    auto attn = attend(g, q, *reads[lw.buffer]);
    attn = mx::reshape(mx::transpose(attn, {0, 2, 1, 3}), {B, 1, H * D});  // (B, 1, H*D)
    h = mx::add(h, rms(tp_sum(g, apply_linear(lw.o, attn)), lw.post_attn_norm, eps));

    auto mlp = [&](const mx::array& in) {  // the dense MLP (the experts' GeGLU stays stock, as eagerly)
      auto gate = apply_linear(lw.gate, in), up = apply_linear(lw.up, in);
      return tp_sum(g, apply_linear(lw.down, g.fast_gated ? fast_gated_activation(gate, up, "gelu_approx")
                                                          : gated(cfg, gate, up)));
    };
    mx::array r = mlp(rms(h, lw.mlp_norm, eps));
    if (cfg.num_experts > 0) {
      auto h1 = rms(r, lw.post_mlp_norm_1, eps);
      auto [idx, weights] = route(cfg, lw, h);
      auto h2 = tp_sum(g, switch_glu(cfg, lw.expert_gate, lw.expert_up, lw.expert_down, rms(h, lw.mlp_norm_2, eps), idx, weights,
                                          g.tp.has_value()));
      r = mx::add(h1, rms(h2, lw.post_mlp_norm_2, eps));
    }
    h = mx::add(h, rms(r, lw.post_mlp_norm, eps));
    if (pli) {
      auto mine = mx::reshape(mx::slice(*pli, {0, 0, i, 0}, {B, 1, i + 1, P}), {B, 1, P});  // (B, 1, P)
      auto gate = mx::multiply(gelu_approx(apply_linear(lw.pli_gate, h)), mine);  // (B, 1, P)
      h = mx::add(h, rms(apply_linear(lw.pli_proj, gate), lw.pli_norm, eps));
    }
    h = mx::multiply(h, *lw.layer_scalar);
  }

  if (logit_rows) {
    h = mx::take(h, *logit_rows, 0);  // (M, 1, E): the head runs on these rows only
  }
  h = rms(h, g.norm, eps);
  auto logits = g.lm_head.present() ? apply_linear(g.lm_head, h) : embed_as_linear(g.embed, h);
  logits = tp_gather_logits(g, logits);  // (B, 1, vocab)
  if (cfg.final_logit_softcap) {
    auto cap = scalar(*cfg.final_logit_softcap, logits.dtype());
    logits = mx::multiply(mx::tanh(mx::divide(logits, cap)), cap);
  }
  return mx::reshape(logits, {logits.shape(0), logits.shape(-1)});  // (B or M, vocab)
}

void load_gemma4_weights(
    DecodeStep::Graph& g,
    const std::unordered_map<std::string, mx::array>& weights,
    const std::unordered_map<std::string, QuantSpec>& quantization) {
  const auto& cfg = g.cfg;
  const auto& fast = cfg.cpu_kernel_linears;
  auto linear = [&](const std::string& name, bool required = true) {
    return with_tuned_product(read_linear(weights, quantization, fast, name, required), cfg);
  };
  auto need = [&](const std::string& name) { return require_weight(weights, name); };
  g.embed = linear("embed");
  g.lm_head = linear("lm_head", /*required=*/false);
  g.norm = need("norm.weight");
  g.dtype = g.embed.quantized() ? g.embed.scales->dtype() : g.embed.w->dtype();
  if (cfg.activation != "gelu_tanh") {
    throw std::invalid_argument("[DecodeStep] gemma4 uses the 'gelu_tanh' activation, got '" +
                                cfg.activation + "'.");
  }

  auto w = std::make_shared<Gemma4Weights>();
  if (cfg.per_layer_width > 0) {
    w->embed_per_layer = linear("embed_per_layer");
    w->per_layer_proj = linear("per_layer_proj");
    w->per_layer_proj_norm = need("per_layer_proj_norm.weight");
  }
  std::vector<int> buffer_of(cfg.num_layers, -1);
  std::vector<mx::array> derived;
  for (int i = 0; i < cfg.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    Gemma4Layer lw;
    lw.kv_heads = layer_kv_heads(cfg, i);
    lw.head_dim = layer_head_dim(cfg, i);
    lw.window = cfg.windows[i];
    lw.rope = cfg.ropes[i];
    const int donor = cfg.kv_donors.empty() ? -1 : cfg.kv_donors[i];
    lw.owns_kv = donor == -1;
    lw.buffer = lw.owns_kv ? w->buffers++ : buffer_of[donor];
    buffer_of[i] = lw.buffer;
    lw.q = linear(p + "q");
    lw.o = linear(p + "o");
    lw.gate = linear(p + "gate");
    lw.up = linear(p + "up");
    lw.down = linear(p + "down");
    if (lw.owns_kv) {
      lw.k = linear(p + "k");
      lw.v = linear(p + "v", /*required=*/false);  // absent: attention_k_eq_v
      lw.k_norm = need(p + "k_norm.weight");
    }
    lw.attn_norm = need(p + "attn_norm.weight");
    lw.post_attn_norm = need(p + "post_attn_norm.weight");
    lw.mlp_norm = need(p + "mlp_norm.weight");
    lw.post_mlp_norm = need(p + "post_mlp_norm.weight");
    lw.q_norm = need(p + "q_norm.weight");
    lw.layer_scalar = need(p + "layer_scalar");
    if (cfg.per_layer_width > 0) {
      lw.pli_gate = linear(p + "pli_gate");
      lw.pli_proj = linear(p + "pli_proj");
      lw.pli_norm = need(p + "pli_norm.weight");
    }
    if (cfg.num_experts > 0) {
      lw.router = linear(p + "router");
      auto scale = need(p + "router_scale");
      lw.router_scale = mx::multiply(
          scale, scalar(std::pow(static_cast<double>(cfg.hidden_size), -0.5), scale.dtype()));
      derived.push_back(*lw.router_scale);
      lw.per_expert_scale = need(p + "per_expert_scale");
      lw.expert_gate = linear(p + "experts.gate");
      lw.expert_up = linear(p + "experts.up");
      lw.expert_down = linear(p + "experts.down");
      // Expert parallel: this rank holds num_experts / group size of them.
      const int held = g.tp ? cfg.num_experts / g.tp->size() : cfg.num_experts;
      for (const auto* e : {&lw.expert_gate, &lw.expert_up, &lw.expert_down}) {
        if (e->w->ndim() != 3 || e->w->shape(0) != held || e->fast) {
          throw std::invalid_argument("[DecodeStep] " + p +
                                      "experts.* must be (experts held, out, in) and run on MLX's kernels.");
        }
      }
      lw.mlp_norm_2 = need(p + "mlp_norm_2.weight");
      lw.post_mlp_norm_1 = need(p + "post_mlp_norm_1.weight");
      lw.post_mlp_norm_2 = need(p + "post_mlp_norm_2.weight");
    }
    w->layers.push_back(std::move(lw));
  }
  if (!derived.empty()) {
    mx::eval(derived);
  }
  g.gemma4 = std::move(w);
}

}  // namespace mlx_infer
