// Routed experts of the decode forward (qwen3_moe's and gpt_oss's instead of the MLP, gemma4's beside it):
// the router's top-k experts of each row, SwitchGLU over them, then the routing-weighted sum.
#include <optional>

#include "graph.h"

namespace mlx_infer {

std::pair<mx::array, mx::array> route_experts(const DecodeConfig& cfg, const LayerWeights& lw, const mx::array& x,
                                              const mx::array& h) {
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

}  // namespace mlx_infer
