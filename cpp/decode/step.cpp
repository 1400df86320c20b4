// DecodeStep: the KV buffers, their growth, prefix take-over and the commit of
// one step (see decode.h for the layout and the transactional rule).
#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "graph.h"
#include "lora.h"
#include "weights.h"

namespace mlx_infer {

namespace {

mx::Dtype parse_dtype(const std::string& name) {
  if (name == "bfloat16" || name == "bf16") return mx::bfloat16;
  if (name == "float16" || name == "f16") return mx::float16;
  if (name == "float32" || name == "f32") return mx::float32;
  throw std::invalid_argument("[DecodeStep] kv_dtype must be 'bfloat16', 'float16', 'float32' or '' "
                              "(the prefix's dtype), got '" + name + "'.");
}

}  // namespace

void validate_decode_config(const DecodeConfig& c) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("[DecodeStep] " + what);
  };
  if (c.num_layers < 1) fail("num_layers must be >= 1.");
  if (c.num_heads < 1 || c.num_kv_heads < 1 || c.num_heads % c.num_kv_heads != 0) {
    fail("num_heads must be a positive multiple of num_kv_heads.");
  }
  if (c.head_dim < 1 || c.hidden_size < 1 || c.vocab_size < 1) fail("sizes must be positive.");
  if (static_cast<int>(c.windows.size()) != c.num_layers) {
    fail("windows needs one entry per layer (0 for a global layer).");
  }
  if (static_cast<int>(c.ropes.size()) != c.num_layers) fail("ropes needs one RopeSpec per layer.");
  for (int w : c.windows) {
    if (w < 0) fail("a sliding window must be >= 1 (0 = global).");
  }
  const bool gemma4 = c.family == "gemma4";
  if (!gemma4 && (!c.layer_kv_heads.empty() || !c.layer_head_dims.empty() || !c.kv_donors.empty() ||
                  c.per_layer_width != 0)) {
    fail("per-layer KV geometry, KV sharing and per-layer inputs are gemma4 switches; "
         "family is '" + c.family + "'.");
  }
  auto per_layer = [&](const std::vector<int>& v, const char* name) {
    if (!v.empty() && static_cast<int>(v.size()) != c.num_layers) {
      fail(std::string(name) + " needs one entry per layer (or none).");
    }
  };
  per_layer(c.layer_kv_heads, "layer_kv_heads");
  per_layer(c.layer_head_dims, "layer_head_dims");
  per_layer(c.kv_donors, "kv_donors");
  for (int i = 0; i < c.num_layers; ++i) {
    const int kvh = layer_kv_heads(c, i), hd = layer_head_dim(c, i);
    if (kvh < 1 || c.num_heads % kvh != 0) fail("num_heads must be a multiple of each layer's KV heads.");
    if (hd < 1) fail("head dims must be positive.");
    const auto& r = c.ropes[i];
    if (r.dims == 0) {  // a layer without RoPE (SmolLM 3's NoPE layers): nothing else to check
      if (r.base || r.freqs) fail("a RopeSpec of dims 0 (no RoPE) takes neither base nor freqs.");
    } else {
      if (r.base.has_value() == r.freqs.has_value()) fail("each RopeSpec needs exactly one of base and freqs.");
      if (r.dims < 2 || r.dims > hd) fail("RopeSpec.dims must be in [2, the layer's head_dim] (0: no RoPE).");
    }
    const int d = c.kv_donors.empty() ? -1 : c.kv_donors[i];
    if (d == -1) continue;
    if (d < 0 || d >= i || c.kv_donors[d] != -1) {
      fail("kv_donors[" + std::to_string(i) + "] must name an earlier layer that owns its KV (or be -1).");
    }
    if (c.windows[d] != c.windows[i] || layer_head_dim(c, d) != hd || layer_kv_heads(c, d) != kvh) {
      fail("KV-shared layer " + std::to_string(i) + " must have its donor's window, head_dim and KV heads.");
    }
  }
  if (c.per_layer_width < 0) fail("per_layer_width must be >= 0.");
  if (c.num_experts < 0 || c.top_k_experts < 0 || (c.num_experts > 0) != (c.top_k_experts > 0) ||
      c.top_k_experts > c.num_experts) {
    fail("the MoE block needs 1 <= top_k_experts <= num_experts (both 0 without one).");
  }
  if (c.activation != "silu" && c.activation != "gelu_tanh" && c.activation != "swiglu_oai") {
    fail("activation must be 'silu', 'gelu_tanh' or 'swiglu_oai', got '" + c.activation + "'.");
  }
  if (!(c.swiglu_limit > 0.0f)) fail("swiglu_limit must be > 0.");
  if (!(c.attn_softcap >= 0.0f) || std::isinf(c.attn_softcap)) {
    fail("attn_softcap must be a finite number >= 0 (0 = no soft cap).");
  }
  if (c.capacity_step < 1) fail("capacity_step must be >= 1.");
  if (c.compile_min_batch < 1) fail("compile_min_batch must be >= 1.");
  if (c.max_capacity < 0) fail("max_capacity must be >= 0 (0 = unbounded).");
  if (!c.kv_dtype.empty()) parse_dtype(c.kv_dtype);
}

namespace {

int round_up(int n, int step) {
  return ((n + step - 1) / step) * step;
}

}  // namespace

int layer_kv_heads(const DecodeConfig& c, int layer) {
  return c.layer_kv_heads.empty() ? c.num_kv_heads : c.layer_kv_heads[layer];
}

int layer_head_dim(const DecodeConfig& c, int layer) {
  return c.layer_head_dims.empty() ? c.head_dim : c.layer_head_dims[layer];
}

std::vector<int> kv_layers(const DecodeConfig& c) {
  std::vector<int> out;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.kv_donors.empty() || c.kv_donors[i] == -1) out.push_back(i);
  }
  return out;
}

DecodeStep::DecodeStep(
    DecodeConfig config,
    const std::unordered_map<std::string, mx::array>& weights,
    const std::unordered_map<std::string, QuantSpec>& quantization) {
  validate_decode_config(config);
  graph_ = std::make_shared<Graph>();
  graph_->cfg = std::move(config);
  load_graph_weights(*graph_, weights, quantization);
  compiled_ = compile_forward(nullptr);
}

// The whole-step function for one adapter layout (none: no adapters). Each mx::compile of a
// capturing lambda has its own cache, dropped with the function, so a new layout never replays
// another's trace.
std::function<std::vector<mx::array>(const std::vector<mx::array>&)> DecodeStep::compile_forward(
    std::shared_ptr<const LoraLayout> lora) const {
  if (!graph_->cfg.compile) {
    return nullptr;
  }
  auto g = graph_;
  return mx::compile(
      [g, lora](const std::vector<mx::array>& in) {
        if (!in.empty() && in[0].is_tracer()) {
          g->traces += 1;  // runs only while tracing: one per (B, capacity) seen
        }
        return decode_forward(*g, in, AttentionRead{}, lora.get());
      },
      /*shapeless=*/false);
}

void DecodeStep::compile_step() {
  compiled_lora_ = lora_ ? compile_forward(lora_) : nullptr;
}

void DecodeStep::set_adapters(const LoraInputs& adapters) {
  if (adapters.empty()) {
    if (lora_) {
      lora_.reset();
      lora_arrays_.clear();
      compile_step();
    }
    return;
  }
  auto layout = make_lora_layout(adapters, linear_outs(*graph_));
  auto arrays = lora_arrays(adapters);
  const bool retrace = !lora_ || lora_->key != layout->key;
  lora_ = std::move(layout);
  lora_arrays_ = std::move(arrays);
  if (retrace) {
    compile_step();
  }
}

std::vector<std::string> DecodeStep::adapter_targets() const {
  std::vector<std::string> out;
  if (lora_) {
    for (const auto& [name, _] : lora_->entries) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

DecodeStep::~DecodeStep() = default;

const DecodeConfig& DecodeStep::config() const {
  return graph_->cfg;
}

int DecodeStep::traces() const {
  return graph_->traces;
}

int64_t DecodeStep::kv_nbytes() const {
  int64_t n = 0;
  for (const auto& a : kv_) {
    n += a.nbytes();
  }
  return n;
}

void DecodeStep::reset() {
  kv_.clear();
  positions_.reset();
  lengths_.clear();
  capacity_ = 0;
  steps_ = 0;
}

std::vector<std::pair<mx::array, mx::array>> DecodeStep::kv_state() const {
  std::vector<std::pair<mx::array, mx::array>> out;
  for (size_t i = 0; i + 1 < kv_.size(); i += 2) {
    out.emplace_back(kv_[i], kv_[i + 1]);
  }
  return out;
}

void DecodeStep::load_prefix(
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const std::vector<int>& lengths) {
  const auto& cfg = graph_->cfg;
  const auto owners = kv_layers(cfg);
  const int L = static_cast<int>(owners.size());
  if (static_cast<int>(keys.size()) != L || static_cast<int>(values.size()) != L) {
    std::ostringstream msg;
    msg << "[DecodeStep.load_prefix] expected " << L
        << " key and value arrays (one per layer, KV-shared layers excepted), got " << keys.size() << " and "
        << values.size() << ".";
    throw std::invalid_argument(msg.str());
  }
  const int B = static_cast<int>(lengths.size());
  if (B < 1) throw std::invalid_argument("[DecodeStep.load_prefix] lengths needs one entry per row.");
  int max_len = 0;
  for (int n : lengths) {
    if (n < 0) throw std::invalid_argument("[DecodeStep.load_prefix] lengths must be >= 0.");
    max_len = std::max(max_len, n);
  }
  const int cap = round_up(max_len + 1, cfg.capacity_step);
  if (cfg.max_capacity > 0 && max_len + 1 > cfg.max_capacity) {
    std::ostringstream msg;
    msg << "[DecodeStep.load_prefix] a row holds " << max_len << " tokens; max_capacity "
        << cfg.max_capacity << " leaves no room for the next one. Raise max_capacity.";
    throw std::runtime_error(msg.str());
  }
  mx::Dtype kv_dtype = cfg.kv_dtype.empty() ? keys[0].dtype() : parse_dtype(cfg.kv_dtype);

  std::vector<mx::array> kv;
  kv.reserve(2 * L);
  for (int i = 0; i < L; ++i) {
    const int layer = owners[i];
    const int kvh = layer_kv_heads(cfg, layer), hd = layer_head_dim(cfg, layer);
    for (const auto* src : {&keys[i], &values[i]}) {
      if (src->ndim() != 4 || src->shape(0) != B || src->shape(1) != kvh || src->shape(3) != hd) {
        std::ostringstream msg;
        msg << "[DecodeStep.load_prefix] layer " << layer << ": expected (" << B << ", " << kvh
            << ", S, " << hd << ") keys/values, got " << src->shape() << ".";
        throw std::invalid_argument(msg.str());
      }
    }
    const int window = cfg.windows[layer];
    const int slots = window > 0 ? std::min(window, cap) : cap;
    const int S = keys[i].shape(2);
    // Source slot of each buffer slot, per row; -1 where the slot stays empty.
    std::vector<int32_t> idx(static_cast<size_t>(B) * slots, 0);
    std::vector<uint8_t> valid(static_cast<size_t>(B) * slots, 0);
    for (int b = 0; b < B; ++b) {
      const int n = lengths[b];
      if (S < std::min(n, slots)) {
        std::ostringstream msg;
        msg << "[DecodeStep.load_prefix] layer " << layer << " row " << b << " holds " << n
            << " tokens but only " << S << " were given; a " << (window > 0 ? "sliding" : "global")
            << " layer needs the last " << std::min(n, slots) << ".";
        throw std::invalid_argument(msg.str());
      }
      for (int j = 0; j < slots; ++j) {
        int p;  // the position that lives in slot j
        if (window > 0) {
          if (n - 1 < j) continue;
          p = j + slots * ((n - 1 - j) / slots);
        } else {
          if (j >= n) continue;
          p = j;
        }
        const int s = p - n + S;
        if (s < 0) continue;
        idx[b * slots + j] = s;
        valid[b * slots + j] = 1;
      }
    }
    auto idx_a = mx::array(idx.begin(), {B, 1, slots, 1}, mx::int32);
    auto valid_a = mx::astype(mx::array(valid.begin(), {B, 1, slots, 1}, mx::uint8), mx::bool_);
    for (const auto* src : {&keys[i], &values[i]}) {
      mx::Shape shape{B, kvh, slots, hd};
      if (S == 0) {
        kv.push_back(mx::zeros(shape, kv_dtype));
        continue;
      }
      auto g = mx::take_along_axis(mx::astype(*src, kv_dtype), idx_a, 2);  // (B, KVH, slots, D)
      kv.push_back(mx::where(valid_a, g, mx::zeros({1}, kv_dtype)));
    }
  }
  auto positions = mx::array(lengths.begin(), {B}, mx::int32);
  std::vector<mx::array> to_eval = kv;
  to_eval.push_back(positions);
  mx::eval(to_eval);
  kv_ = std::move(kv);
  positions_ = positions;
  lengths_ = lengths;
  capacity_ = cap;
  steps_ = 0;
}

mx::array DecodeStep::step(const mx::array& tokens, const std::optional<mx::array>& adapter_slots) {
  const auto& cfg = graph_->cfg;
  if (!loaded()) {
    throw std::invalid_argument("[DecodeStep.step] no cache loaded: call load_prefix first "
                                "(with zero lengths to start from an empty cache).");
  }
  const int B = batch_size();
  if (tokens.size() != static_cast<size_t>(B) || tokens.ndim() > 2 ||
      !mx::issubdtype(tokens.dtype(), mx::integer)) {
    std::ostringstream msg;
    msg << "[DecodeStep.step] expected " << B << " integer token ids (one per row), got shape "
        << tokens.shape() << " of " << tokens.dtype() << ".";
    throw std::invalid_argument(msg.str());
  }
  const int needed = *std::max_element(lengths_.begin(), lengths_.end()) + 1;
  if (cfg.max_capacity > 0 && needed > cfg.max_capacity) {
    std::ostringstream msg;
    msg << "[DecodeStep.step] capacity exhausted: the next token would be number " << needed
        << " of a row, over max_capacity " << cfg.max_capacity << ".";
    throw std::runtime_error(msg.str());
  }

  // Everything below builds into locals; members change only at the commit.
  std::vector<mx::array> inputs;
  inputs.reserve(2 + kv_.size());
  inputs.push_back(mx::astype(mx::reshape(tokens, {B}), mx::int32));
  inputs.push_back(*positions_);
  int cap = capacity_;
  if (needed > cap) {
    cap = round_up(needed, cfg.capacity_step);
    if (cfg.max_capacity > 0) cap = std::min(cap, cfg.max_capacity);
  }
  const auto owners = kv_layers(cfg);
  for (int i = 0; i < static_cast<int>(owners.size()); ++i) {
    const int window = cfg.windows[owners[i]];
    const int slots = window > 0 ? std::min(window, cap) : cap;
    for (int j = 0; j < 2; ++j) {
      const auto& buf = kv_[2 * i + j];
      const int have = buf.shape(2);
      if (slots > have) {  // growth; a ring below its window has not wrapped yet
        auto shape = buf.shape();
        shape[2] = slots - have;
        inputs.push_back(mx::concatenate({buf, mx::zeros(shape, buf.dtype())}, 2));
      } else {
        inputs.push_back(buf);
      }
    }
  }

  // Without slots no row has an adapter: the step runs without the update (nothing to pay).
  const bool adapted = lora_ && adapter_slots.has_value();
  if (adapted) {
    inputs.push_back(lora_slots(adapter_slots, B, "DecodeStep.step"));
    inputs.insert(inputs.end(), lora_arrays_.begin(), lora_arrays_.end());
  }
  const auto& compiled = adapted ? compiled_lora_ : compiled_;

  std::vector<mx::array> outputs;
  if (compiled && B >= cfg.compile_min_batch) {
    outputs = compiled(inputs);
  } else {
    AttentionRead read;
    if (std::all_of(lengths_.begin(), lengths_.end(), [&](int n) { return n == lengths_[0]; })) {
      read.uniform_length = lengths_[0] + 1;
    }
    outputs = decode_forward(*graph_, inputs, read, adapted ? lora_.get() : nullptr);
  }
  inputs.clear();

  // Commit. The old buffers are now referenced only by the new graph, so MLX
  // may write the new token into them in place.
  positions_ = outputs[1];
  kv_.assign(outputs.begin() + 2, outputs.end());
  for (auto& n : lengths_) {
    n += 1;
  }
  capacity_ = cap;
  steps_ += 1;
  return outputs[0];
}

}  // namespace mlx_infer
