// The building blocks of the decode forward (forward.cpp), each the MLX ops of its eager layer in the
// same order (python/mlx_infer/layers, models/*.py), and the plain step's K/V access (DecodeStep's
// buffers) and graph (decode_forward).
#include "graph.h"

#include "lora.h"

#include "mlx_infer/backend.h"
#include "mlx_infer/cpu_attention.h"
#include "mlx_infer/matmul.h"
#include "mlx_infer/softcap_attention.h"

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>

namespace mlx_infer {

namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // math.sqrt(2 / math.pi), as nn.gelu_approx

}  // namespace

mx::array scalar(double v, mx::Dtype dtype) {
  return mx::array(static_cast<float>(v), dtype);
}

mx::array apply_linear(const Linear& l, const mx::array& x) {
  if (auto y = lora_linear(l, x)) {
    return *y;
  }
  return base_linear(l, x);
}

// nn.Linear / nn.QuantizedLinear (and their CPU-kernel twins in mlx_infer.layers.linear).
mx::array base_linear(const Linear& l, const mx::array& x) {
  if (l.fast) {
    if (l.quantized()) {
      auto y = fast_quantized_matmul(x, *l.w, *l.scales, l.biases, true, l.group_size, l.bits, l.mode);
      return l.bias ? mx::add(y, *l.bias) : y;
    }
    return fast_linear(x, *l.w, l.bias);
  }
  if (l.quantized()) {
    auto y = quantized_linear(x, *l.w, *l.scales, l.biases, l.group_size, l.bits, l.mode);
    return l.bias ? mx::add(y, *l.bias) : y;
  }
  if (l.tuned && !skinny_linear_applies(x, *l.w, l.bias)) {
    return tuned_linear(x, *l.w, l.bias);
  }
  return transposed_product(l, x);
}

// x @ w.T (+ bias) over the pre-transposed view where the load made one (dense_linear's product, one node
// fewer a call), else dense_linear.
mx::array transposed_product(const Linear& l, const mx::array& x) {
  if (!l.wt || skinny_linear_applies(x, *l.w, l.bias)) {
    return dense_linear(x, *l.w, l.bias);
  }
  return l.bias ? mx::addmm(*l.bias, x, *l.wt, 1.0f, 1.0f) : mx::matmul(x, *l.wt);
}

// nn.Embedding / nn.QuantizedEmbedding lookup: ids (...) -> (..., hidden).
mx::array embed_lookup(const Linear& e, const mx::array& ids) {
  if (e.quantized()) {
    std::optional<mx::array> biases;
    if (e.biases) {
      biases = mx::take(*e.biases, ids, 0);
    }
    return mx::dequantize(mx::take(*e.w, ids, 0), mx::take(*e.scales, ids, 0), biases,
                          e.group_size, e.bits, e.mode);
  }
  return mx::take(*e.w, ids, 0);
}

// Embedding.as_linear / QuantizedEmbedding.as_linear.
mx::array embed_as_linear(const Linear& e, const mx::array& x) {
  if (e.fast) {
    return e.quantized()
        ? fast_quantized_matmul(x, *e.w, *e.scales, e.biases, true, e.group_size, e.bits, e.mode)
        : fast_linear(x, *e.w);
  }
  if (e.quantized()) {
    return quantized_linear(x, *e.w, *e.scales, e.biases, e.group_size, e.bits, e.mode);
  }
  if (e.tuned && !skinny_linear_applies(x, *e.w)) {
    return tuned_linear(x, *e.w);
  }
  return transposed_product(e, x);
}

void init_tensor_parallel(DecodeStep::Graph& g) {
  if (g.cfg.tp_backend.empty()) {
    g.tp.reset();
    return;
  }
  // The backend's group is a per-process singleton: Python joined it (mlx_infer.parallel.group),
  // this returns the same one.
  g.tp = mx::distributed::init(/*strict=*/true, g.cfg.tp_backend);
}

mx::array tp_sum(const DecodeStep::Graph& g, const mx::array& x) {
  return g.tp ? mx::distributed::all_sum(x, *g.tp) : x;
}

mx::array tp_embed_lookup(const DecodeStep::Graph& g, const Linear& e, const mx::array& ids, int start) {
  if (!g.tp || !g.cfg.vocab_parallel) {
    return embed_lookup(e, ids);
  }
  const int rows = e.w->shape(0);
  auto local = mx::subtract(ids, mx::array(start, ids.dtype()));  // (B,)
  auto mine = mx::logical_and(mx::greater_equal(local, mx::array(0, ids.dtype())),
                              mx::less(local, mx::array(rows, ids.dtype())));
  auto h = embed_lookup(e, mx::where(mine, local, mx::array(0, ids.dtype())));  // (B, E)
  h = mx::multiply(h, mx::astype(mx::expand_dims(mine, -1), h.dtype()));  // other ranks' tokens: 0
  return mx::distributed::all_sum(h, *g.tp);
}

mx::array tp_gather_logits(const DecodeStep::Graph& g, const mx::array& logits) {
  if (!g.tp || !g.cfg.vocab_parallel) {
    return logits;
  }
  const int N = g.tp->size();
  auto shape = logits.shape();
  const int n = shape.back();
  auto flat = mx::reshape(logits, {-1, n});  // (M, n)
  const int M = flat.shape(0);
  auto all = mx::distributed::all_gather(flat, *g.tp);  // (N * M, n), rank order
  all = mx::transpose(mx::reshape(all, {N, M, n}), {1, 0, 2});  // (M, N, n)
  shape.back() = N * n;
  return mx::reshape(all, shape);  // (..., V)
}

mx::array rms(const mx::array& x, const std::optional<mx::array>& w, float eps) {
  return mx::fast::rms_norm(x, w, eps);
}

namespace {

// mx::fast::rope of y (B, N, T, D) at offset (B,) or a scalar with one table (``freqs``, or r.base when none).
// Splits the rows where MLX's CUDA kernel cannot take them at once.
mx::array rope_table(const mx::array& y, const RopeSpec& r, const std::optional<mx::array>& freqs,
                     const mx::array& offset) {
  const auto base = freqs ? std::nullopt : r.base;
  const int B = y.shape(0);
  const int rows = rope_rows_per_call(B, y.shape(1), y.shape(2), r.dims);
  if (rows >= B) {
    return mx::fast::rope(y, r.dims, r.traditional, base, r.scale, offset, freqs);
  }
  std::vector<mx::array> parts;
  for (int b = 0; b < B; b += rows) {
    const int e = std::min(B, b + rows);
    auto shape = y.shape();
    shape[0] = e;
    std::vector<int> lo(y.ndim(), 0);
    lo[0] = b;
    auto part = mx::slice(y, mx::Shape(lo.begin(), lo.end()), shape);
    auto off = offset.ndim() == 0 ? offset : mx::slice(offset, {b}, {e});
    parts.push_back(mx::fast::rope(part, r.dims, r.traditional, base, r.scale, off, freqs));
  }
  return mx::concatenate(parts, 0);
}

}  // namespace

mx::array rope(const mx::array& x, const RopeSpec& r, const mx::array& offset,
               const std::optional<mx::array>& call_ends) {
  if (r.dims == 0) {
    return x;  // a layer without RoPE
  }
  auto y = x;
  if (r.mscale != 1.0f) {  // YarnRoPE / LongRoPE: x.at[..., :dims].multiply(mscale)
    int D = x.shape(-1);
    auto m = scalar(r.mscale, x.dtype());
    if (r.dims == D) {
      y = mx::multiply(x, m);
    } else {
      auto shape = x.shape();
      auto head = mx::slice(x, {0, 0, 0, 0}, {shape[0], shape[1], shape[2], r.dims});
      auto tail = mx::slice(x, {0, 0, 0, r.dims}, shape);
      y = mx::concatenate({mx::multiply(head, m), tail}, -1);
    }
  }
  // x: (B, N, T, D), offset: (B,) or a scalar.
  if (!r.long_freqs) {
    return rope_table(y, r, r.freqs, offset);
  }
  // LongRoPE: mx.where((end > original).reshape(-1, 1, 1, 1), rope(long), rope(short)), end each row's call end.
  if (!call_ends) {
    throw std::invalid_argument("[DecodeStep] a LongRoPE layer needs each row's call end.");
  }
  auto is_long = mx::reshape(mx::greater(*call_ends, mx::array(r.original, call_ends->dtype())),
                             {-1, 1, 1, 1});  // (B, 1, 1, 1)
  return mx::where(is_long, rope_table(y, r, r.long_freqs, offset), rope_table(y, r, r.freqs, offset));
}

namespace {

// nn.silu(gate) * up  /  nn.gelu_approx(gate) * up  /  gpt_oss.swiglu_oai(gate, up, limit), op for op.
std::vector<mx::array> swiglu_ops(const std::vector<mx::array>& in) {
  const auto& gate = in[0];
  return {mx::multiply(mx::multiply(gate, mx::sigmoid(gate)), in[1])};
}

std::vector<mx::array> geglu_ops(const std::vector<mx::array>& in) {
  const auto& gate = in[0];
  auto dt = gate.dtype();
  auto inner = mx::add(gate, mx::multiply(scalar(0.044715, dt), mx::power(gate, scalar(3, dt))));
  auto t = mx::tanh(mx::multiply(scalar(kSqrt2OverPi, dt), inner));
  auto act = mx::multiply(mx::multiply(scalar(0.5, dt), gate), mx::add(scalar(1, dt), t));
  return {mx::multiply(act, in[1])};
}

constexpr double kSwigluAlpha = 1.702;  // gpt_oss.swiglu_oai's alpha

// gpt_oss.swiglu_oai: the gate clipped from above at limit, the linear part to +-limit and shifted by 1.
std::vector<mx::array> swiglu_oai_ops(const std::vector<mx::array>& in, float limit) {
  const auto dt = in[0].dtype();
  auto gate = mx::minimum(in[0], scalar(limit, dt));
  auto x = mx::clip(in[1], scalar(-limit, dt), scalar(limit, dt));
  return {mx::multiply(mx::add(x, scalar(1.0, dt)),
                       mx::multiply(gate, mx::sigmoid(mx::multiply(scalar(kSwigluAlpha, dt), gate))))};
}

// One shapeless-compiled swiglu_oai per limit (its constant, as mx.compile keys it in Python).
const std::function<std::vector<mx::array>(const std::vector<mx::array>&)>& swiglu_oai(float limit) {
  static std::mutex mu;
  static std::map<float, std::function<std::vector<mx::array>(const std::vector<mx::array>&)>> fns;
  std::lock_guard<std::mutex> lock(mu);
  auto it = fns.find(limit);
  if (it == fns.end()) {
    auto fn = [limit](const std::vector<mx::array>& in) { return swiglu_oai_ops(in, limit); };
    it = fns.emplace(limit, mx::compile(std::function<std::vector<mx::array>(const std::vector<mx::array>&)>(fn),
                                        /*shapeless=*/true)).first;
  }
  return it->second;
}

}  // namespace

// Shapeless-compiled, as mlx-lm compiles its activations: one fused kernel when
// the step is built op by op; inlined when the whole step is being traced.
mx::array gated(const DecodeConfig& cfg, const mx::array& gate, const mx::array& up) {
  static auto swiglu = mx::compile(swiglu_ops, /*shapeless=*/true);
  static auto geglu = mx::compile(geglu_ops, /*shapeless=*/true);
  if (cfg.activation == "swiglu_oai") {
    return swiglu_oai(cfg.swiglu_limit)({gate, up})[0];
  }
  return (cfg.activation == "gelu_tanh" ? geglu : swiglu)({gate, up})[0];
}

mx::array attend(const DecodeStep::Graph& g, const mx::array& q, const AttentionInputs& in,
                 const std::optional<mx::array>& sinks) {
  const auto& cfg = g.cfg;
  if (cfg.attn_softcap > 0.0f) {  // no fused kernel has the cap: the eager graph's composed ops
    return softcapped_attention(q, in.keys, in.values, cfg.attn_scale, cfg.attn_softcap, in.mask, sinks);
  }
  const std::string mode = in.mask ? "array" : "";
  return g.fast_attention && !sinks  // sinks: MLX's SDPA always, as layers/attention.py runs them
      ? fast_sdpa(q, in.keys, in.values, cfg.attn_scale, mode, in.mask)
      : mx::fast::scaled_dot_product_attention(q, in.keys, in.values, cfg.attn_scale, mode, in.mask, sinks);
}

// Writes one token per row into a (B, KVH, S, D) buffer at slot[b].
mx::array write_slot(const mx::array& buf, const mx::array& x, const mx::array& slot,
                     std::optional<int> static_slot) {
  auto upd = mx::astype(x, buf.dtype());  // (B, KVH, 1, D)
  int B = buf.shape(0);
  if (static_slot) {
    auto stop = buf.shape();
    stop[2] = *static_slot + 1;
    return mx::slice_update(buf, upd, {0, 0, *static_slot, 0}, stop);
  }
  if (B == 1) {
    return mx::slice_update(buf, upd, mx::reshape(slot, {1}), {2});
  }
  auto rows = mx::arange(0, B, 1, mx::int32);
  auto shaped = mx::expand_dims(upd, 1);  // (B, 1, KVH, 1, D)
  return mx::scatter(buf, {rows, slot}, shaped, {0, 2});
}

namespace {

// The caller's buffers (DecodeStep::step): per KV-owning layer (B, KVH, S, D), the new token
// written at its window group's slot per row, the group's read length per row visible.
class BufferKV final : public KVAccess {
 public:
  BufferKV(const std::vector<mx::array>& inputs, std::vector<int> buffer_group, const AttentionRead& read,
           std::vector<mx::array>& outputs)
      : inputs_(inputs), buffer_group_(std::move(buffer_group)), read_(read), outputs_(outputs) {}

  AttentionInputs write_read(int i, const mx::array& k, const mx::array& v) override {
    const auto& kbuf = inputs_[4 + 2 * i];
    const auto& vbuf = inputs_[5 + 2 * i];
    const int grp = buffer_group_[i];
    const int B = kbuf.shape(0), KVH = kbuf.shape(1), S = kbuf.shape(2), D = kbuf.shape(3);

    std::optional<int> static_slot;
    if (read_.uniform) static_slot = (*read_.uniform)[grp].first;
    auto slot = static_slot ? mx::array(0) : column(1, grp, B);  // (B,)
    auto new_k = write_slot(kbuf, k, slot, static_slot);  // (B, KVH, S, D)
    auto new_v = write_slot(vbuf, v, slot, static_slot);
    outputs_.push_back(new_k);
    outputs_.push_back(new_v);

    if (read_.uniform) {
      const int n = (*read_.uniform)[grp].second;
      if (n < S) {
        return {mx::slice(new_k, {0, 0, 0, 0}, {B, KVH, n, D}),
                mx::slice(new_v, {0, 0, 0, 0}, {B, KVH, n, vbuf.shape(3)}), std::nullopt};
      }
      return {new_k, new_v, std::nullopt};
    }
    return {new_k, new_v, mask_for(grp, S, B)};
  }

 private:
  // Column ``grp`` of the (B, G) input ``which`` (1: slots, 2: reads) as (B,), built once per group.
  mx::array column(int which, int grp, int B) {
    auto key = std::make_pair(which, grp);
    auto it = columns_.find(key);
    if (it != columns_.end()) return it->second;
    const auto& m = inputs_[1 + which];
    auto c = mx::reshape(mx::slice(m, {0, grp}, {B, grp + 1}), {B});
    columns_.emplace(key, c);
    return c;
  }

  // One mask per (group, buffer length): slot s of row b is visible iff s < reads[b, grp].
  mx::array mask_for(int grp, int S, int B) {
    auto key = std::make_pair(grp, S);
    auto it = masks_.find(key);
    if (it != masks_.end()) return it->second;
    auto lim = mx::reshape(column(2, grp, B), {B, 1, 1, 1});
    auto m = mx::less(mx::reshape(mx::arange(0, S, 1, mx::int32), {1, 1, 1, S}), lim);  // (B, 1, 1, S)
    masks_.emplace(key, m);
    return m;
  }

  const std::vector<mx::array>& inputs_;
  const std::vector<int> buffer_group_;
  const AttentionRead& read_;
  std::vector<mx::array>& outputs_;
  std::map<std::pair<int, int>, mx::array> columns_;
  std::map<std::pair<int, int>, mx::array> masks_;
};

}  // namespace

std::pair<std::vector<int>, std::vector<int>> window_groups(const DecodeStep::Graph& g) {
  const auto windows = buffer_windows(g);
  std::vector<int> groups(windows);
  std::sort(groups.begin(), groups.end());
  groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
  std::vector<int> of;
  for (int w : windows) {
    of.push_back(static_cast<int>(std::lower_bound(groups.begin(), groups.end(), w) - groups.begin()));
  }
  return {groups, of};
}

std::vector<mx::array> decode_forward(
    const DecodeStep::Graph& g,
    const std::vector<mx::array>& inputs,
    const AttentionRead& read,
    const LoraLayout* lora) {
  const int kv_end = 4 + 2 * num_buffers(g);
  if (static_cast<int>(inputs.size()) != kv_end + (lora ? lora->count : 0)) {
    throw std::invalid_argument("[decode_forward] expected tokens, positions, slots, reads, 2 KV buffers per "
                                "KV-owning layer and the adapters' arrays.");
  }
  LoraScope scope(lora, &inputs, kv_end);
  std::vector<mx::array> outputs;
  outputs.reserve(kv_end - 3);
  outputs.push_back(mx::array(0));  // logits, set below
  BufferKV kv(inputs, window_groups(g).second, read, outputs);
  outputs[0] = layers_forward(g, inputs[0], inputs[1], kv);
  return outputs;
}

int num_buffers(const DecodeStep::Graph& g) {
  return static_cast<int>(g.buffer_layer.size());
}

std::vector<BufferGeometry> buffer_geometry(const DecodeStep::Graph& g) {
  std::vector<BufferGeometry> out;
  for (int i : g.buffer_layer) {
    const auto& lw = g.layers[i];
    out.push_back({lw.kv_heads, lw.head_dim, lw.value_dim, lw.window});
  }
  return out;
}

std::vector<int> buffer_windows(const DecodeStep::Graph& g) {
  std::vector<int> out;
  for (const auto& b : buffer_geometry(g)) out.push_back(b.window);
  return out;
}

}  // namespace mlx_infer
