// The readers of a decode step's weights: a layer's weights found by canonical name (decode.h), the
// projections fused where DecodeConfig::fuse_projections allows, and the check that every weight the
// binding handed over was read (the C++ half of the parameter-coverage check; see
// python/mlx_infer/generation/bindings/graph_spec.py's check_every_parameter_used).
#include "weights.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

namespace mlx_infer {

namespace {

// The weight names the graph being loaded has read (see load_graph_weights): every name the binding passes must be
// one the step reads, so a weight the translation names wrongly, or one this step has no use for, is an error
// instead of silently ignored.
thread_local std::unordered_set<std::string>* t_read_names = nullptr;

struct ReadNames {
  std::unordered_set<std::string> names;
  ReadNames() { t_read_names = &names; }
  ~ReadNames() { t_read_names = nullptr; }
  ReadNames(const ReadNames&) = delete;
  ReadNames& operator=(const ReadNames&) = delete;
};

void check_every_weight_read(const std::unordered_map<std::string, mx::array>& weights,
                             const std::unordered_set<std::string>& read) {
  std::vector<std::string> unused;
  for (const auto& [name, _] : weights) {
    if (!read.count(name)) unused.push_back(name);
  }
  if (unused.empty()) return;
  std::sort(unused.begin(), unused.end());
  std::string list;
  for (size_t i = 0; i < unused.size() && i < 8; ++i) list += (i ? ", '" : "'") + unused[i] + "'";
  if (unused.size() > 8) list += ", ... (" + std::to_string(unused.size()) + " in all)";
  throw std::invalid_argument("[DecodeStep] weights the step does not use: " + list +
                              " (an unknown name, or a weight this family's step has no place for).");
}

}  // namespace

std::optional<mx::array> find_weight(const std::unordered_map<std::string, mx::array>& w,
                                     const std::string& name) {
  if (t_read_names != nullptr) t_read_names->insert(name);
  auto it = w.find(name);
  if (it == w.end()) {
    return std::nullopt;
  }
  return it->second;
}

mx::array require_weight(const std::unordered_map<std::string, mx::array>& w, const std::string& name) {
  auto a = find_weight(w, name);
  if (!a) {
    throw std::invalid_argument("[DecodeStep] missing weight '" + name + "'.");
  }
  return *a;
}

Linear read_linear(const std::unordered_map<std::string, mx::array>& w,
                   const std::unordered_map<std::string, QuantSpec>& quant,
                   const std::vector<std::string>& fast, const std::string& name,
                   bool required) {
  Linear l;
  l.name = name;
  l.fast = std::find(fast.begin(), fast.end(), name) != fast.end();
  l.w = required ? std::optional<mx::array>(require_weight(w, name + ".weight"))
                 : find_weight(w, name + ".weight");
  if (!l.w) {
    return l;
  }
  l.bias = find_weight(w, name + ".bias");
  auto q = quant.find(name);
  if (q != quant.end()) {
    l.scales = require_weight(w, name + ".scales");
    l.biases = find_weight(w, name + ".biases");
    std::tie(l.group_size, l.bits, l.mode) = q->second;
  }
  return l;
}

Linear with_tuned_product(Linear l, const DecodeConfig& cfg) {
  l.tuned = cfg.tuned_products && l.present() && !l.fast && !l.quantized();
  return l;
}

std::unordered_map<std::string, int> linear_outs(const DecodeStep::Graph& g) {
  std::unordered_map<std::string, int> out;
  auto add = [&out](const Linear& l) {
    if (l.present() && !l.name.empty()) out.emplace(l.name, l.w->shape(0));
  };
  for (const auto& lw : g.layers) {
    for (const auto* l : {&lw.q, &lw.k, &lw.v, &lw.o, &lw.gate, &lw.up, &lw.down, &lw.pli_gate, &lw.pli_proj,
                          &lw.q_a, &lw.q_b, &lw.kv_a, &lw.shared_gate, &lw.shared_up, &lw.shared_down}) {
      add(*l);
    }
    for (const auto* l : {&lw.qkv, &lw.gate_up}) {  // a fused form: by its members, or (fused in the
      if (!l->present()) continue;                    // checkpoint: phi3, glm4) by its own name
      add(*l);
      for (const auto& [name, rows] : l->members) out.emplace(name, rows);
    }
  }
  return out;
}

namespace {

bool same_kind(const Linear& a, const Linear& b) {
  if (a.quantized() != b.quantized() || a.fast != b.fast || a.bias.has_value() != b.bias.has_value() ||
      a.biases.has_value() != b.biases.has_value() || a.w->dtype() != b.w->dtype()) {
    return false;
  }
  return !a.quantized() || (a.group_size == b.group_size && a.bits == b.bits && a.mode == b.mode);
}

// Rows of W (and of its scales, biases and bias) concatenated: one matmul for several outputs.
Linear fuse(const std::vector<const Linear*>& ls) {
  Linear out = *ls[0];
  out.name.clear();  // adapters target its members
  for (auto* l : ls) out.members.emplace_back(l->name, l->w->shape(0));
  auto cat = [&](auto member) {
    std::vector<mx::array> parts;
    for (auto* l : ls) {
      parts.push_back(*(l->*member));
    }
    return mx::concatenate(parts, 0);
  };
  out.w = cat(&Linear::w);
  if (out.scales) out.scales = cat(&Linear::scales);
  if (out.biases) out.biases = cat(&Linear::biases);
  if (out.bias) out.bias = cat(&Linear::bias);
  return out;
}

}  // namespace

namespace {

// Gives every dense 2-D product weight its transpose view (Linear::wt), appended to ``derived`` to be
// evaluated with the load's other derived arrays: a view of the same buffer, so no memory, and each step's
// graph reads it instead of transposing w again (one node a product: 65 of a llama-1B step's 685).
void pretranspose(DecodeStep::Graph& g, std::vector<mx::array>& derived) {
  auto give = [&derived](Linear& l) {
    if (l.present() && !l.fast && !l.quantized() && l.w->ndim() == 2) {
      l.wt = mx::transpose(*l.w);  // (in, out)
      derived.push_back(*l.wt);
    }
  };
  give(g.embed);  // the tied head's product (embed_as_linear)
  give(g.lm_head);
  give(g.per_layer_proj);
  for (auto& lw : g.layers) {
    for (auto* l : {&lw.q, &lw.k, &lw.v, &lw.o, &lw.gate, &lw.up, &lw.down, &lw.qkv, &lw.gate_up, &lw.router,
                    &lw.pli_gate, &lw.pli_proj, &lw.shared_gate, &lw.shared_up, &lw.shared_down, &lw.q_a,
                    &lw.q_b, &lw.kv_a}) {
      give(*l);
    }
  }
}

}  // namespace

void load_graph_weights(
    DecodeStep::Graph& g,
    const std::unordered_map<std::string, mx::array>& weights,
    const std::unordered_map<std::string, QuantSpec>& quantization) {
  const auto& cfg = g.cfg;
  const auto& fast = cfg.cpu_kernel_linears;
  g.fast_attention = std::find(fast.begin(), fast.end(), "attention") != fast.end();
  g.fast_gated = std::find(fast.begin(), fast.end(), "gated_activation") != fast.end();
  init_tensor_parallel(g);
  ReadNames read;
  auto linear = [&](const std::string& name, bool required = true) {
    return with_tuned_product(read_linear(weights, quantization, fast, name, required), cfg);
  };
  auto need = [&](const std::string& name) { return require_weight(weights, name); };
  g.embed = linear("embed");
  g.lm_head = linear("lm_head", /*required=*/false);
  g.norm = need("norm.weight");
  g.dtype = g.embed.quantized() ? g.embed.scales->dtype() : g.embed.w->dtype();
  if (cfg.per_layer_width > 0) {
    g.embed_per_layer = linear("embed_per_layer");
    g.per_layer_proj = linear("per_layer_proj");
    g.per_layer_proj_norm = need("per_layer_proj_norm.weight");
  }
  std::vector<mx::array> derived;  // evaluated once, here, not in the first step
  auto keep = [&derived](const Linear& l) {
    for (const auto* a : {&l.w, &l.scales, &l.biases, &l.bias}) {
      if (*a) derived.push_back(**a);
    }
  };
  std::vector<int> buffer_of(cfg.num_layers, -1);
  for (int i = 0; i < cfg.num_layers; ++i) {
    std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights lw;
    lw.kv_heads = layer_kv_heads(cfg, i);
    lw.head_dim = layer_head_dim(cfg, i);
    lw.value_dim = layer_value_dim(cfg, i);
    lw.window = cfg.windows[i];
    lw.rope = cfg.ropes[i];
    const int donor = cfg.kv_donors.empty() ? -1 : cfg.kv_donors[i];
    lw.owns_kv = donor == -1;
    if (lw.owns_kv) {
      lw.buffer = static_cast<int>(g.buffer_layer.size());
      g.buffer_layer.push_back(i);
    } else {
      lw.buffer = buffer_of[donor];
      g.layers[donor].shared = true;
    }
    buffer_of[i] = lw.buffer;
    const bool v_from_k = !cfg.v_from_k.empty() && cfg.v_from_k[i] != 0;
    // Handed over fused (bindings/fused.py: the model's q/k/v and gate/up are views of these), or
    // one product each.
    lw.qkv = linear(p + "qkv", /*required=*/false);
    lw.gate_up = linear(p + "gate_up", /*required=*/false);
    // Their members, in output order, as the forward splits them: what adapters on q/k/v, gate/up target.
    if (lw.qkv.present()) {
      const int H = cfg.num_heads * lw.head_dim, KV = lw.kv_heads * lw.head_dim;
      if (!lw.owns_kv || v_from_k || lw.qkv.w->shape(0) != H + 2 * KV) {
        throw std::invalid_argument("[DecodeStep] " + p + "qkv has " + std::to_string(lw.qkv.w->shape(0)) +
                                    " output rows, not (num_heads + 2 num_kv_heads) head_dim = " +
                                    std::to_string(H + 2 * KV) + " (a KV-shared or v_from_k layer has none).");
      }
      lw.qkv.members = {{p + "q", H}, {p + "k", KV}, {p + "v", KV}};
    }
    if (lw.gate_up.present()) {
      const int I = lw.gate_up.w->shape(0) / 2;
      lw.gate_up.members = {{p + "gate", I}, {p + "up", I}};
    }
    // A MoE layer: the router and the experts, instead of the MLP or (moe_beside_mlp) beside it.
    lw.router = linear(p + "router", /*required=*/cfg.moe_beside_mlp);
    if (lw.router.present()) {
      if (cfg.num_experts < 1) {
        throw std::invalid_argument("[DecodeStep] " + p + "router is given but num_experts is 0.");
      }
      lw.expert_gate = linear(p + "experts.gate");
      lw.expert_up = linear(p + "experts.up");
      lw.expert_down = linear(p + "experts.down");
      if (cfg.moe_beside_mlp) {
        auto scale = need(p + "router_scale");
        lw.router_scale = mx::multiply(
            scale, scalar(std::pow(static_cast<double>(cfg.hidden_size), -0.5), scale.dtype()));
        derived.push_back(*lw.router_scale);
        lw.per_expert_scale = need(p + "per_expert_scale");
        lw.mlp_norm_2 = need(p + "mlp_norm_2.weight");
        lw.post_mlp_norm_1 = need(p + "post_mlp_norm_1.weight");
        lw.post_mlp_norm_2 = need(p + "post_mlp_norm_2.weight");
        // Expert parallel: this rank holds num_experts / group size of them.
        const int held = g.tp ? cfg.num_experts / g.tp->size() : cfg.num_experts;
        for (const auto* e : {&lw.expert_gate, &lw.expert_up, &lw.expert_down}) {
          if (e->w->ndim() != 3 || e->w->shape(0) != held || e->fast) {
            throw std::invalid_argument("[DecodeStep] " + p +
                                        "experts.* must be (experts held, out, in) and run on MLX's kernels.");
          }
        }
      }
    }
    if (lw.router.present() && cfg.moe_noaux_tc) {  // deepseek_v3's MoEGate: x @ weight.T, its own matmul
      if (lw.router.quantized() || lw.router.bias || lw.router.fast) {
        throw std::invalid_argument("[DecodeStep] " + p + "router of noaux_tc routing must be a dense weight "
                                    "without a bias (MoEGate's).");
      }
      lw.router_bias = need(p + "router.correction_bias");
    }
    // Shared experts (deepseek_v3): beside the routed ones, always on.
    lw.shared_gate = linear(p + "shared.gate", /*required=*/false);
    if (lw.shared_gate.present()) {
      if (!lw.router.present() || cfg.moe_beside_mlp) {
        throw std::invalid_argument("[DecodeStep] " + p + "shared.* (shared experts) needs routed experts "
                                    "instead of the MLP.");
      }
      lw.shared_up = linear(p + "shared.up");
      lw.shared_down = linear(p + "shared.down");
    }
    const bool mla = cfg.kv_lora_rank > 0;
    if (mla) {  // multi-head latent attention: queries through a LoRA (q_a, q_b) or q, the latent, per-head maps
      lw.q_a = linear(p + "q_a", /*required=*/false);
      if (lw.q_a.present()) {
        lw.q_a_norm = need(p + "q_a_norm.weight");
        lw.q_b = linear(p + "q_b");
      }
      lw.kv_a = linear(p + "kv_a");
      lw.kv_a_norm = need(p + "kv_a_norm.weight");
      // MultiLinear: MLX's own products (never the CPU kernels or tuned ones), as the model runs them.
      lw.embed_q = read_linear(weights, quantization, {}, p + "embed_q");
      lw.unembed_out = read_linear(weights, quantization, {}, p + "unembed_out");
      for (const auto* m : {&lw.embed_q, &lw.unembed_out}) {
        if (m->w->ndim() != 3 || m->w->shape(0) != cfg.num_heads || m->bias) {
          throw std::invalid_argument("[DecodeStep] " + m->name + " must be (num_heads, out, in) per-head matrices "
                                      "without a bias, got " + std::to_string(m->w->ndim()) + " dims.");
        }
      }
    }
    const bool experts_only = lw.router.present() && !cfg.moe_beside_mlp;
    for (auto [field, name] : {std::pair{&LayerWeights::q, "q"}, {&LayerWeights::k, "k"},
                               {&LayerWeights::v, "v"}, {&LayerWeights::o, "o"},
                               {&LayerWeights::gate, "gate"}, {&LayerWeights::up, "up"},
                               {&LayerWeights::down, "down"}}) {
      const std::string n = name;
      if ((lw.qkv.present() && (n == "q" || n == "k" || n == "v")) ||
          (lw.gate_up.present() && (n == "gate" || n == "up")) ||
          (experts_only && (n == "gate" || n == "up" || n == "down")) ||
          (!lw.owns_kv && (n == "k" || n == "v")) || (v_from_k && n == "v") ||
          (mla && (n == "k" || n == "v" || (n == "q" && lw.q_a.present())))) {
        continue;  // MLA: the latent instead of k and v; q from q_a / q_b where the queries have a LoRA
      }
      lw.*field = linear(p + name);
    }
    if (cfg.pre_norms) {
      lw.attn_norm = need(p + "attn_norm.weight");
      lw.mlp_norm = need(p + "mlp_norm.weight");
    } else if (!find_weight(weights, p + "post_attn_norm.weight")) {
      throw std::invalid_argument("[DecodeStep] " + p + "has neither pre- nor post-norms (pre_norms is off).");
    }
    lw.post_attn_norm = find_weight(weights, p + "post_attn_norm.weight");
    lw.post_mlp_norm = find_weight(weights, p + "post_mlp_norm.weight");
    lw.sinks = find_weight(weights, p + "sinks");
    lw.q_norm = find_weight(weights, p + "q_norm.weight");
    if (lw.owns_kv) {
      lw.k_norm = find_weight(weights, p + "k_norm.weight");
      if (lw.q_norm.has_value() != lw.k_norm.has_value()) {
        throw std::invalid_argument("[DecodeStep] " + p + "q_norm and k_norm must come together.");
      }
    } else if (lw.q_norm.has_value() != g.layers[donor].q_norm.has_value()) {
      throw std::invalid_argument("[DecodeStep] " + p + "q_norm must be given as its KV donor's is.");
    }
    if (lw.post_attn_norm.has_value() != lw.post_mlp_norm.has_value()) {
      throw std::invalid_argument("[DecodeStep] " + p +
                                  "post_attn_norm and post_mlp_norm must come together.");
    }
    if (cfg.layer_scalars) {
      lw.layer_scalar = need(p + "layer_scalar");
    }
    if (cfg.per_layer_width > 0) {
      lw.pli_gate = linear(p + "pli_gate");
      lw.pli_proj = linear(p + "pli_proj");
      lw.pli_norm = need(p + "pli_norm.weight");
    }
    if (cfg.fuse_projections) {
      // The fused copies replace the separate weights in this graph (the model keeps its own).
      if (!lw.qkv.present() && lw.k.present() && lw.v.present() && same_kind(lw.q, lw.k) &&
          same_kind(lw.q, lw.v)) {
        lw.qkv = fuse({&lw.q, &lw.k, &lw.v});
        lw.q = lw.k = lw.v = Linear{};
        keep(lw.qkv);
      }
      if (!lw.gate_up.present() && lw.gate.present() && same_kind(lw.gate, lw.up)) {
        lw.gate_up = fuse({&lw.gate, &lw.up});
        lw.gate = lw.up = Linear{};
        keep(lw.gate_up);
      }
    }
    g.layers.push_back(std::move(lw));
  }
  check_every_weight_read(weights, read.names);
  pretranspose(g, derived);
  if (!derived.empty()) {
    mx::eval(derived);
  }
}

}  // namespace mlx_infer
