// Routed experts of the decode forward (qwen3_moe's, gpt_oss's and deepseek_v3's instead of the MLP, gemma4's
// beside it): the router's top-k experts of each row, SwitchGLU over them, then the routing-weighted sum;
// deepseek_v3's shared experts.
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "graph.h"

namespace mlx_infer {

namespace {

using CompiledFn = std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;

// Axis ``axis`` (negative: from the end) of ``a`` cut to its first n entries: Python's a[..., :n] (axis -1)
// or a[..., :n, :] (axis -2).
mx::array leading(const mx::array& a, int n, int axis) {
  auto stop = a.shape();
  stop[a.ndim() + axis] = n;
  return mx::slice(a, mx::Shape(a.ndim(), 0), stop);
}

// models/deepseek_v3.py's group_expert_select (noaux_tc), op for op: in = {gates (B, 1, E), bias (E,)} ->
// {indices (B, 1, k) uint32, weights (B, 1, k) float32}.
std::vector<mx::array> group_select_ops(const std::vector<mx::array>& in, int top_k, int n_group, int topk_group,
                                        float routed_scaling_factor, bool norm_topk_prob) {
  auto scores = mx::sigmoid(mx::astype(in[0], mx::float32));  // (B, 1, E)
  auto orig_scores = scores;
  scores = mx::add(scores, in[1]);  // the correction bias: for the selection only
  if (n_group > 1) {
    scores = mx::unflatten(scores, -1, {n_group, -1});  // (B, 1, G, E/G)
    auto group_scores = mx::sum(mx::topk(scores, 2, -1), -1, /*keepdims=*/true);  // (B, 1, G, 1)
    const int k = n_group - topk_group;
    auto group_idx = leading(mx::argpartition(group_scores, k - 1, -2), k, -2);  // (B, 1, k, 1): the worst groups
    scores = mx::put_along_axis(scores, mx::stop_gradient(group_idx), mx::array(0.0f), -2);
    scores = mx::flatten(scores, -2, -1);  // (B, 1, E)
  }
  auto inds = mx::stop_gradient(leading(mx::argpartition(mx::negative(scores), top_k - 1, -1), top_k, -1));
  auto weights = mx::take_along_axis(orig_scores, inds, -1);  // (B, 1, k)
  if (top_k > 1 && norm_topk_prob) {
    weights = mx::divide(weights, mx::sum(weights, -1, /*keepdims=*/true));
  }
  return {inds, mx::multiply(weights, scalar(routed_scaling_factor, weights.dtype()))};
}

// group_select_ops compiled as models/deepseek_v3.py compiles group_expert_select (@mx.compile, its Python
// arguments constants of the trace): one compiled function per setting.
const CompiledFn& group_select(const DecodeConfig& cfg) {
  using Key = std::tuple<int, int, int, float, bool>;
  static std::mutex mu;
  static std::map<Key, CompiledFn> fns;
  const Key key{cfg.top_k_experts, cfg.moe_groups, cfg.moe_topk_groups, cfg.routed_scaling_factor,
                cfg.norm_topk_prob};
  std::lock_guard<std::mutex> lock(mu);
  auto it = fns.find(key);
  if (it == fns.end()) {
    auto fn = [key](const std::vector<mx::array>& in) {
      auto [top_k, n_group, topk_group, scale, norm] = key;
      return group_select_ops(in, top_k, n_group, topk_group, scale, norm);
    };
    it = fns.emplace(key, mx::compile(CompiledFn(fn), /*shapeless=*/false)).first;
  }
  return it->second;
}

}  // namespace

std::pair<mx::array, mx::array> route_experts(const DecodeConfig& cfg, const LayerWeights& lw, const mx::array& x,
                                              const mx::array& h) {
  if (cfg.moe_noaux_tc) {  // deepseek_v3's MoEGate: x @ weight.T, then group_expert_select
    auto gates = lw.router.wt ? mx::matmul(x, *lw.router.wt) : mx::matmul(x, mx::transpose(*lw.router.w));  // (B, 1, E)
    auto out = group_select(cfg)({gates, *lw.router_bias});
    return {out[0], out[1]};
  }
  const int E = cfg.num_experts, k = cfg.top_k_experts;
  auto top_k = [&](const mx::array& scores) {  // (B, 1, E) -> the k largest's ids (B, 1, k)
    auto part = mx::argpartition(scores, E - k, -1);
    return mx::slice(part, {0, 0, E - k}, part.shape());
  };
  if (cfg.moe_beside_mlp) {  // gemma4's Router: the top k of rms(h) * scale's scores, softmaxed, per-expert scaled
    auto scores = apply_linear(lw.router, rms(h, lw.router_scale, cfg.rms_norm_eps));  // (B, 1, E)
    auto idx = top_k(scores);
    auto weights = mx::softmax(mx::take_along_axis(scores, idx, -1), -1, /*precise=*/false);
    return {idx, mx::multiply(weights, mx::take(*lw.per_expert_scale, idx, 0))};
  }
  auto logits = apply_linear(lw.router, x);  // (B, 1, E)
  // qwen3_moe: the softmax over all experts, then the top k; gpt_oss: the top k logits, then their softmax.
  auto gates = cfg.moe_softmax_topk ? logits : mx::softmax(logits, -1, /*precise=*/true);
  auto idx = top_k(gates);
  auto scores = mx::take_along_axis(gates, idx, -1);
  if (cfg.moe_softmax_topk) {
    scores = mx::softmax(scores, -1, /*precise=*/true);
  } else if (cfg.norm_topk_prob) {
    scores = mx::divide(scores, mx::sum(scores, -1, /*keepdims=*/true));
  }
  return {idx, scores};
}

// SwitchLinear / QuantizedSwitchLinear, and their per-expert bias (gpt_oss).
mx::array switch_linear(const Linear& l, const mx::array& x, const mx::array& idx, bool sorted) {
  mx::array y(0);
  if (l.quantized()) {
    y = mx::gather_qmm(x, *l.w, *l.scales, l.biases, std::nullopt, idx, /*transpose=*/true,
                       l.group_size, l.bits, l.mode, std::nullopt, sorted);
  } else {
    auto w = mx::swapaxes(*l.w, -1, -2);  // (experts, in, out)
    if (x.dtype() != mx::float32 && mx::default_device() == mx::Device::cpu) {
      // MLX's CPU gather_mm computes in float32 only: widen, multiply, round back once (as SwitchLinear does).
      y = mx::astype(mx::gather_mm(mx::astype(x, mx::float32), mx::astype(w, mx::float32), std::nullopt, idx,
                                   sorted),
                     x.dtype());
    } else {
      y = mx::gather_mm(x, w, std::nullopt, idx, sorted);
    }
  }
  if (l.bias) {
    y = mx::add(y, mx::expand_dims(mx::take(*l.bias, idx, 0), -2));  // (..., 1, out): each row's expert's bias
  }
  return y;
}

mx::array switch_glu(const DecodeConfig& cfg, const Linear& gate_e, const Linear& up_e, const Linear& down_e,
                     const mx::array& x_in, const mx::array& global_indices, const mx::array& global_weights,
                     bool expert_parallel) {
  auto indices = global_indices;
  auto weights = global_weights;
  if (expert_parallel) {
    const int n = gate_e.w->shape(0);
    auto local = mx::subtract(indices, mx::array(cfg.expert_start, indices.dtype()));  // (B, 1, k)
    auto mine = mx::logical_and(mx::greater_equal(local, mx::array(0, local.dtype())),
                                mx::less(local, mx::array(n, local.dtype())));
    indices = mx::where(mine, local, mx::array(0, local.dtype()));
    weights = mx::multiply(weights, mx::astype(mine, weights.dtype()));
  }
  auto x = mx::expand_dims(x_in, {-2, -3});  // (B, 1, 1, 1, D)
  // Many rows: sorted by expert, as the eager graph does from 64 routed rows on.
  const bool do_sort = indices.size() >= 64;
  auto idx = indices;
  std::optional<mx::array> inv_order;
  if (do_sort) {
    const int k = indices.shape(-1);
    auto flat = mx::flatten(indices);
    auto order = mx::argsort(flat);
    inv_order = mx::argsort(order);
    x = mx::take(mx::flatten(x, 0, -3), mx::floor_divide(order, mx::array(k, order.dtype())), 0);
    idx = mx::take(flat, order, 0);  // (B*k,)
  }
  auto up = switch_linear(up_e, x, idx, do_sort);
  auto gate = switch_linear(gate_e, x, idx, do_sort);
  auto y = switch_linear(down_e, gated(cfg, gate, up), idx, do_sort);
  if (do_sort) {
    y = mx::unflatten(mx::take(y, *inv_order, 0), 0, indices.shape());
  }
  y = mx::squeeze(y, -2);                                          // (B, 1, k, D)
  return mx::sum(mx::multiply(mx::expand_dims(weights, -1), y), -2);  // (B, 1, D)
}

// deepseek_v3's MLP of the shared experts (models/deepseek_v3.py's MLP): down(swiglu(gate(x), up(x))).
mx::array shared_experts(const DecodeStep::Graph& g, const LayerWeights& lw, const mx::array& x) {
  return apply_linear(lw.shared_down, gated(g.cfg, apply_linear(lw.shared_gate, x), apply_linear(lw.shared_up, x)));
}

}  // namespace mlx_infer
