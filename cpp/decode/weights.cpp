// The readers of a decode step's weights: a layer's weights found by canonical name (decode.h), the
// projections fused where DecodeConfig::fuse_projections allows, and the check that every weight the
// binding handed over was read (the C++ half of the parameter-coverage check; see
// python/mlx_infer/generation/bindings/graph_spec.py's check_every_parameter_used).
#include "weights.h"

#include "gemma4.h"

#include <algorithm>
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
    for (const auto* l : {&lw.q, &lw.k, &lw.v, &lw.o, &lw.gate, &lw.up, &lw.down}) add(*l);
    for (const auto* l : {&lw.qkv, &lw.gate_up}) {  // a fused form: by its members, or (fused in the
      if (!l->present()) continue;                    // checkpoint: phi3, glm4) by its own name
      add(*l);
      for (const auto& [name, rows] : l->members) out.emplace(name, rows);
    }
  }
  if (g.gemma4) {
    for (const auto& lw : g.gemma4->layers) {
      for (const auto* l : {&lw.q, &lw.k, &lw.v, &lw.o, &lw.gate, &lw.up, &lw.down, &lw.pli_gate, &lw.pli_proj}) add(*l);
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
  if (cfg.family == "gemma4") {
    load_gemma4_weights(g, weights, quantization);
    check_every_weight_read(weights, read.names);
    return;
  }
  g.embed = linear("embed");
  g.lm_head = linear("lm_head", /*required=*/false);
  g.norm = require_weight(weights, "norm.weight");
  g.dtype = g.embed.quantized() ? g.embed.scales->dtype() : g.embed.w->dtype();
  std::vector<mx::array> fused;  // evaluated once, here, not in the first step
  auto keep = [&fused](const Linear& l) {
    for (const auto* a : {&l.w, &l.scales, &l.biases, &l.bias}) {
      if (*a) fused.push_back(**a);
    }
  };
  for (int i = 0; i < cfg.num_layers; ++i) {
    std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights lw;
    // Handed over fused (bindings/fused.py: the model's q/k/v and gate/up are views of these), or
    // one product each.
    lw.qkv = linear(p + "qkv", /*required=*/false);
    lw.gate_up = linear(p + "gate_up", /*required=*/false);
    // Their members, in output order, as the forward splits them: what adapters on q/k/v, gate/up target.
    if (lw.qkv.present()) {
      const int H = cfg.num_heads * cfg.head_dim, KV = cfg.num_kv_heads * cfg.head_dim;
      if (lw.qkv.w->shape(0) != H + 2 * KV) {
        throw std::invalid_argument("[DecodeStep] " + p + "qkv has " + std::to_string(lw.qkv.w->shape(0)) +
                                    " output rows, not (num_heads + 2 num_kv_heads) head_dim = " +
                                    std::to_string(H + 2 * KV) + ".");
      }
      lw.qkv.members = {{p + "q", H}, {p + "k", KV}, {p + "v", KV}};
    }
    if (lw.gate_up.present()) {
      const int I = lw.gate_up.w->shape(0) / 2;
      lw.gate_up.members = {{p + "gate", I}, {p + "up", I}};
    }
    lw.router = linear(p + "router", /*required=*/false);  // a MoE layer
    if (lw.router.present()) {
      lw.expert_gate = linear(p + "experts.gate");
      lw.expert_up = linear(p + "experts.up");
      lw.expert_down = linear(p + "experts.down");
    }
    for (auto [field, name] : {std::pair{&LayerWeights::q, "q"}, {&LayerWeights::k, "k"},
                               {&LayerWeights::v, "v"}, {&LayerWeights::o, "o"},
                               {&LayerWeights::gate, "gate"}, {&LayerWeights::up, "up"},
                               {&LayerWeights::down, "down"}}) {
      const std::string n = name;
      if ((lw.qkv.present() && (n == "q" || n == "k" || n == "v")) ||
          (lw.gate_up.present() && (n == "gate" || n == "up")) ||
          (lw.router.present() && (n == "gate" || n == "up" || n == "down"))) {
        continue;
      }
      lw.*field = linear(p + name);
    }
    if (cfg.pre_norms) {
      lw.attn_norm = require_weight(weights, p + "attn_norm.weight");
      lw.mlp_norm = require_weight(weights, p + "mlp_norm.weight");
    } else if (!find_weight(weights, p + "post_attn_norm.weight")) {
      throw std::invalid_argument("[DecodeStep] " + p + "has neither pre- nor post-norms (pre_norms is off).");
    }
    lw.post_attn_norm = find_weight(weights, p + "post_attn_norm.weight");
    lw.post_mlp_norm = find_weight(weights, p + "post_mlp_norm.weight");
    lw.sinks = find_weight(weights, p + "sinks");
    lw.q_norm = find_weight(weights, p + "q_norm.weight");
    lw.k_norm = find_weight(weights, p + "k_norm.weight");
    if (lw.q_norm.has_value() != lw.k_norm.has_value()) {
      throw std::invalid_argument("[DecodeStep] " + p + "q_norm and k_norm must come together.");
    }
    if (lw.post_attn_norm.has_value() != lw.post_mlp_norm.has_value()) {
      throw std::invalid_argument("[DecodeStep] " + p +
                                  "post_attn_norm and post_mlp_norm must come together.");
    }
    lw.window = cfg.windows[i];
    lw.rope = cfg.ropes[i];
    if (cfg.fuse_projections) {
      // The fused copies replace the separate weights in this graph (the model keeps its own).
      if (!lw.qkv.present() && same_kind(lw.q, lw.k) && same_kind(lw.q, lw.v)) {
        lw.qkv = fuse({&lw.q, &lw.k, &lw.v});
        lw.q = lw.k = lw.v = Linear{};
        keep(lw.qkv);
      }
      if (!lw.gate_up.present() && same_kind(lw.gate, lw.up)) {
        lw.gate_up = fuse({&lw.gate, &lw.up});
        lw.gate = lw.up = Linear{};
        keep(lw.gate_up);
      }
    }
    g.layers.push_back(std::move(lw));
  }
  check_every_weight_read(weights, read.names);
  if (!fused.empty()) {
    mx::eval(fused);
  }
}

}  // namespace mlx_infer
