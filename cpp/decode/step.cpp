// DecodeStep: one step over the caller's K/V buffers, checked before anything is built
// (see decode.h for the slots, reads and window groups).
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <tuple>

#include "graph.h"
#include "mlx_infer/text.h"
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
  auto per_layer = [&](const std::vector<int>& v, const char* name) {
    if (!v.empty() && static_cast<int>(v.size()) != c.num_layers) {
      fail(std::string(name) + " needs one entry per layer (or none).");
    }
  };
  per_layer(c.layer_kv_heads, "layer_kv_heads");
  per_layer(c.layer_head_dims, "layer_head_dims");
  per_layer(c.kv_donors, "kv_donors");
  per_layer(c.v_from_k, "v_from_k");
  if (c.moe_beside_mlp && c.num_experts == 0) fail("moe_beside_mlp needs num_experts > 0.");
  const bool mla = c.kv_lora_rank > 0;
  if (c.kv_lora_rank < 0) fail("kv_lora_rank must be >= 0 (0 = no multi-head latent attention).");
  if (mla) {
    if (c.qk_nope_head_dim < 1 || c.qk_rope_head_dim < 2 || c.v_head_dim < 1) {
      fail("multi-head latent attention needs qk_nope_head_dim >= 1, qk_rope_head_dim >= 2 and v_head_dim >= 1.");
    }
    if (c.num_kv_heads != 1 || c.head_dim != c.kv_lora_rank) {
      fail("multi-head latent attention caches one KV head whose K is the latent: num_kv_heads must be 1 and "
           "head_dim kv_lora_rank (" + std::to_string(c.kv_lora_rank) + ").");
    }
    if (!c.layer_kv_heads.empty() || !c.layer_head_dims.empty() || !c.kv_donors.empty() || !c.v_from_k.empty() ||
        c.v_norm || c.per_layer_width > 0 || c.attn_softcap > 0.0f) {
      fail("multi-head latent attention takes none of the per-layer KV geometry, KV sharing, v_from_k, v_norm, "
           "per-layer inputs or attn_softcap.");
    }
  }
  if (c.moe_noaux_tc) {
    if (c.num_experts < 1 || c.moe_beside_mlp || c.moe_softmax_topk) {
      fail("moe_noaux_tc needs num_experts > 0 and neither moe_beside_mlp nor moe_softmax_topk.");
    }
    if (c.moe_groups < 1 || c.num_experts % c.moe_groups != 0 || c.moe_topk_groups < 1 ||
        c.moe_topk_groups > c.moe_groups || (c.moe_groups > 1 && c.num_experts / c.moe_groups < 2)) {
      fail("moe_noaux_tc needs moe_groups dividing num_experts (at least 2 experts a group when > 1 group) and "
           "1 <= moe_topk_groups <= moe_groups.");
    }
  }
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
    if (r.long_freqs) {  // LongRoPE: freqs the short table, long_freqs the long one, both (dims / 2,)
      const auto half = static_cast<size_t>(r.dims / 2);
      if (!r.freqs || r.freqs->ndim() != 1 || r.freqs->size() != half || r.long_freqs->ndim() != 1 ||
          r.long_freqs->size() != half) {
        fail("a LongRoPE RopeSpec needs freqs (the short table) and long_freqs, each of shape (dims / 2,).");
      }
      if (r.original < 1) fail("a LongRoPE RopeSpec needs original (original_max_position_embeddings) >= 1.");
      if (mla) fail("multi-head latent attention takes no LongRoPE (long_freqs).");
    }
    if (mla && r.dims != c.qk_rope_head_dim) {
      fail("multi-head latent attention rotates the whole RoPE part: each RopeSpec.dims must be qk_rope_head_dim.");
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
  if (c.compile_min_batch < 1) fail("compile_min_batch must be >= 1.");
  if (c.max_capacity < 0) fail("max_capacity must be >= 0 (0 = unbounded).");
  if (!c.kv_dtype.empty()) parse_dtype(c.kv_dtype);
}

int layer_kv_heads(const DecodeConfig& c, int layer) {
  return c.layer_kv_heads.empty() ? c.num_kv_heads : c.layer_kv_heads[layer];
}

int layer_head_dim(const DecodeConfig& c, int layer) {
  return c.layer_head_dims.empty() ? c.head_dim : c.layer_head_dims[layer];
}

int layer_value_dim(const DecodeConfig& c, int layer) {
  return c.kv_lora_rank > 0 ? c.qk_rope_head_dim : layer_head_dim(c, layer);
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
  std::tie(groups_, buffer_group_) = mlx_infer::window_groups(*graph_);
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
          g->traces += 1;  // runs only while tracing: one per input-shape signature seen
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

namespace {

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("[DecodeStep.step] " + what);
}

}  // namespace

DecodeStepOutput DecodeStep::step(const mx::array& tokens, const std::vector<int>& positions,
                                  const std::vector<std::vector<int>>& slots,
                                  const std::vector<std::vector<int>>& reads, const std::vector<mx::array>& keys,
                                  const std::vector<mx::array>& values,
                                  const std::optional<mx::array>& adapter_slots) {
  const auto& cfg = graph_->cfg;
  const int B = static_cast<int>(positions.size());
  if (B < 1) bad("positions needs one entry per row.");
  if (tokens.size() != static_cast<size_t>(B) || tokens.ndim() > 2 || !mx::issubdtype(tokens.dtype(), mx::integer)) {
    bad("expected " + std::to_string(B) + " integer token ids (one per row), got shape " +
        shape_text(tokens.shape()) + " of " + dtype_text(tokens.dtype()) + ".");
  }
  const int G = static_cast<int>(groups_.size());
  if (static_cast<int>(slots.size()) != G || static_cast<int>(reads.size()) != G) {
    bad("slots and reads need one list per window group (window_groups: " + std::to_string(G) + "), got " +
        std::to_string(slots.size()) + " and " + std::to_string(reads.size()) + ".");
  }
  if (*std::min_element(positions.begin(), positions.end()) < 0) bad("positions must be >= 0.");
  const int needed = *std::max_element(positions.begin(), positions.end()) + 1;
  if (cfg.max_capacity > 0 && needed > cfg.max_capacity) {
    throw std::runtime_error("[DecodeStep.step] capacity exhausted: the next token would be number " +
                             std::to_string(needed) + " of a row, over max_capacity " +
                             std::to_string(cfg.max_capacity) + ".");
  }
  const auto geometry = buffer_geometry(*graph_);
  const int L = static_cast<int>(geometry.size());
  if (static_cast<int>(keys.size()) != L || static_cast<int>(values.size()) != L) {
    bad("expected " + std::to_string(L) + " key and value arrays (one per KV-owning layer), got " +
        std::to_string(keys.size()) + " and " + std::to_string(values.size()) + ".");
  }
  // Per group, the narrowest buffer: every slot and read must fit in it.
  std::vector<int> width(G, -1);
  for (int i = 0; i < L; ++i) {
    const auto& geo = geometry[i];
    for (const auto* a : {&keys[i], &values[i]}) {
      const int width = a == &keys[i] ? geo.head_dim : geo.value_dim;
      if (a->ndim() != 4 || a->shape(0) != B || a->shape(1) != geo.kv_heads || a->shape(3) != width ||
          a->shape(2) != keys[i].shape(2)) {
        bad("buffer " + std::to_string(i) + ": expected (" + std::to_string(B) + ", " + std::to_string(geo.kv_heads) +
            ", S, " + std::to_string(geo.head_dim) + ") keys and (" + std::to_string(B) + ", " +
            std::to_string(geo.kv_heads) + ", S, " + std::to_string(geo.value_dim) + ") values of one S, got " +
            shape_text(keys[i].shape()) + " and " + shape_text(values[i].shape()) + ".");
      }
    }
    const int grp = buffer_group_[i];
    width[grp] = width[grp] < 0 ? keys[i].shape(2) : std::min(width[grp], keys[i].shape(2));
  }
  bool uniform = true;
  for (int grp = 0; grp < G; ++grp) {
    for (const auto* list : {&slots[grp], &reads[grp]}) {
      if (static_cast<int>(list->size()) != B) {
        bad(std::string(list == &slots[grp] ? "slots" : "reads") + "[" + std::to_string(grp) + "] has " +
            std::to_string(list->size()) + " entries; it needs one per row (" + std::to_string(B) + ").");
      }
    }
    for (int b = 0; b < B; ++b) {
      const int s = slots[grp][b], n = reads[grp][b];
      if (s < 0 || s >= width[grp] || n <= s || n > width[grp]) {
        bad("window group " + std::to_string(groups_[grp]) + " row " + std::to_string(b) + ": slot " +
            std::to_string(s) + " and read length " + std::to_string(n) +
            " must satisfy 0 <= slot < read <= the buffer's " + std::to_string(width[grp]) + " slots.");
      }
      uniform = uniform && s == slots[grp][0] && n == reads[grp][0];
    }
  }

  std::vector<mx::array> inputs;
  inputs.reserve(4 + 2 * L + lora_arrays_.size() + 1);
  inputs.push_back(mx::astype(mx::reshape(tokens, {B}), mx::int32));
  // positions, slots and reads: views of one host buffer. On CUDA, MLX keeps a host-made array in managed
  // memory and the first kernel reading it waits on a page migration: one buffer, one migration a step.
  std::vector<int32_t> packed(positions.begin(), positions.end());
  for (const auto* m : {&slots, &reads}) {
    const auto& cols = *m;
    for (int b = 0; b < B; ++b) {
      for (int g = 0; g < G; ++g) packed.push_back(cols[g][b]);
    }
  }
  const auto all = mx::array(packed.begin(), {static_cast<int>(packed.size())}, mx::int32);
  const int BG = B * G;
  inputs.push_back(mx::slice(all, {0}, {B}));                                          // (B,) positions
  inputs.push_back(mx::reshape(mx::slice(all, {B}, {B + BG}), {B, G}));                // (B, G) slots
  inputs.push_back(mx::reshape(mx::slice(all, {B + BG}, {B + 2 * BG}), {B, G}));       // (B, G) reads
  for (int i = 0; i < L; ++i) {
    inputs.push_back(keys[i]);
    inputs.push_back(values[i]);
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
    if (uniform) {
      read.uniform.emplace();
      for (int grp = 0; grp < G; ++grp) read.uniform->emplace_back(slots[grp][0], reads[grp][0]);
    }
    outputs = decode_forward(*graph_, inputs, read, adapted ? lora_.get() : nullptr);
  }
  inputs.clear();  // the graph alone references the caller's buffers now
  steps_ += 1;
  DecodeStepOutput out{outputs[0], {}, {}};
  for (int i = 0; i < L; ++i) {
    out.keys.push_back(outputs[1 + 2 * i]);
    out.values.push_back(outputs[2 + 2 * i]);
  }
  return out;
}

}  // namespace mlx_infer
