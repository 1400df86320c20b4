// PagedDecodeStep: the decode step over a paged store's page arrays (see
// mlx_infer/paged_decode.h for the layout, the buckets and the commit rule).
#include "mlx_infer/paged_decode.h"
#include "mlx_infer/text.h"

#include <algorithm>
#include <map>
#include <optional>
#include <stdexcept>

#include "graph.h"
#include "lora.h"
#include "weights.h"
#include "mlx_infer/paged_attention.h"
#include "../attention/qkv_rope_cuda.h"

namespace mlx_infer {

namespace {

constexpr int kGroupInputs = 3;  // block_tables, lengths, write_slots
constexpr int kStepInputs = 5;   // tokens, positions, logit_rows, call_ends, split_counts

// Where a write's R * KVH rows go (row r's KV head h at r * KVH + h): their (page, head, offset) on a GPU,
// one flat row index (page * KVH + head) * P + offset (R * KVH, 1) on the CPU (write_part says why).
struct WriteIndex {
  std::vector<mx::array> at;   // GPU: page, head, offset, each (R * KVH,)
  std::optional<mx::array> flat;  // CPU
};

bool on_cpu() {
  return mx::default_device() == mx::Device::cpu;
}

// ``x`` (R, KVH, [1,] D) written into ``part`` (pages, KVH, P, D) at ``w``: the storage with the new rows (in
// place where MLX may donate the buffer). On a GPU one Scatter over the 4-D storage and one view of x (each
// graph node costs MLX host time every step: views of the storage around a ScatterAxis were 4 of a layer's
// ~42 nodes). MLX's CPU Scatter indexes every element through the three index arrays, slower than
// put_along_axis over the flat view (64 rows x 8 heads x 64 features: 382 against 223 us), so the CPU,
// which runs views for free, keeps the flat form.
mx::array write_part(const mx::array& part, const mx::array& x, const WriteIndex& w) {
  const int D = part.shape(3);
  auto upd = mx::astype(x, part.dtype());
  if (w.flat) {
    auto flat = mx::reshape(part, {-1, D});  // a view: the buffer MLX may update in place
    flat = mx::put_along_axis(flat, mx::broadcast_to(*w.flat, {w.flat->shape(0), D}), mx::reshape(upd, {-1, D}), 0);
    return mx::reshape(flat, part.shape());
  }
  // updates (R * KVH, 1, 1, 1, D): qkv_rope's k and v come in this shape, and a reshape to it is then no node
  return mx::scatter(part, w.at, mx::reshape(upd, {static_cast<int>(upd.size() / D), 1, 1, 1, D}), {0, 1, 2});
}

// The pages of a store. Inputs: tokens, positions, logit_rows, call_ends, split_counts, G groups of
// kGroupInputs, then k_0, v_0, ..., k_{L-1}, v_{L-1}; each layer's updated
// storage is appended to ``outputs`` in that order.
class PagedKV final : public KVAccess {
 public:
  PagedKV(const DecodeStep::Graph& g, const std::vector<int>& layer_groups, int num_groups, bool kernel,
          const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, std::string* backend)
      : g_(g), windows_(buffer_windows(g)), layer_groups_(layer_groups), num_groups_(num_groups), kernel_(kernel), inputs_(inputs),
        outputs_(outputs), backend_(backend), rows_(num_groups) {}

  // The kernel path: write, then paged_attention through the tables (no gathered copy).
  std::optional<mx::array> write_attend(int i, const mx::array& q, const mx::array& k,
                                        const mx::array& v) override {
    const auto& kbuf = key_storage(i);
    const auto backend = kernel_ ? paged_attention_backend(q, kbuf) : std::string("gather");
    if (backend_ != nullptr) {
      *backend_ = backend;
    }
    if (backend == "gather") {
      return std::nullopt;  // Metal, or a shape the kernels do not take: write_read's gather
    }
    auto [new_k, new_v] = write(i, k, v);
    return attend(i, q, new_k, new_v);  // (R, H D)
  }

  // Both paths: the kernel and the gather path rotate alike (one RoPE for both, on CUDA qkv_rope's).
  bool fused_qkv_rope() const override { return qkv_rope_enabled(); }

  // The kernel path on CUDA: qkv_rope writes the new K/V rows into the storage itself (no Scatter, no write
  // index), then paged_attention reads them through the tables; the storage is this layer's output as it came.
  std::optional<mx::array> rope_write_attend(int i, const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope,
                                             const mx::array& positions, const QkNorm* norm) override {
    const auto& kbuf = key_storage(i);
    const auto& vbuf = value_storage(i);
    const auto* in = group_inputs(layer_groups_[i]);
    if (!kernel_ || paged_attention_backend(H, D, qkv.dtype(), kbuf) != "cuda" ||
        !qkv_rope_write_supported(qkv, KVH, D, kbuf, vbuf, in[2])) {
      return std::nullopt;
    }
    if (backend_ != nullptr) {
      *backend_ = "cuda";
    }
    auto q = qkv_rope_write(qkv, H, KVH, D, rope, positions, kbuf, vbuf, in[2], norm);  // (R, H, D)
    outputs_.push_back(kbuf);
    outputs_.push_back(vbuf);
    return attend(i, q, kbuf, vbuf);  // (R, H D)
  }

  // The gather path (reference and fallback): write, gather (R, KVH, S, D), attend under the mask.
  // Multi-head latent attention takes it on every backend (its latent K and RoPE-key V have widths and a
  // score the paged kernels do not take): mla.cpp calls this alone, so it reports the path here.
  AttentionInputs write_read(int i, const mx::array& k, const mx::array& v) override {
    if (g_.cfg.kv_lora_rank > 0 && backend_ != nullptr) {
      *backend_ = "gather";
    }
    const int gi = layer_groups_[i];
    auto [new_k, new_v] = write(i, k, v);
    const auto& r = rows(gi, i);
    auto keys = mx::take(mx::reshape(new_k, {-1, new_k.shape(3)}), r.read, 0);  // (R, KVH, S, D)
    auto values = mx::take(mx::reshape(new_v, {-1, new_v.shape(3)}), r.read, 0);  // (R, KVH, S, Dv)
    return {keys, values, r.mask};
  }

 private:
  // paged_attention of q (R, H, D) over layer i's storage as written this step, through its group's tables.
  mx::array attend(int i, const mx::array& q, const mx::array& k_storage, const mx::array& v_storage) const {
    const auto* in = group_inputs(layer_groups_[i]);
    const auto& sinks = g_.layers[g_.buffer_layer[i]].sinks;
    return paged_attention(q, k_storage, v_storage, in[0], in[1], windows_[i], g_.cfg.attn_scale,
                           g_.cfg.attn_softcap, sinks, {}, /*flat_heads=*/true, /*split_counts=*/inputs_[4]);
  }

  struct Rows {
    mx::array read;  // (R, KVH, S)
    mx::array mask;  // (R, 1, 1, S)
  };

  const mx::array* group_inputs(int g) const { return &inputs_[kStepInputs + kGroupInputs * g]; }
  const mx::array& key_storage(int i) const { return inputs_[kStepInputs + kGroupInputs * num_groups_ + 2 * i]; }
  const mx::array& value_storage(int i) const {
    return inputs_[kStepInputs + 1 + kGroupInputs * num_groups_ + 2 * i];
  }

  // Scatters layer i's new K/V rows; keeps the updated storage as the step's output.
  std::pair<mx::array, mx::array> write(int i, const mx::array& k, const mx::array& v) {
    const int gi = layer_groups_[i];
    const auto& kbuf = key_storage(i);
    if (!writes_.count(gi)) {
      const int kvh = kbuf.shape(1), P = kbuf.shape(2);
      const auto& slots = group_inputs(gi)[2];
      const int R = slots.shape(0);
      auto Pa = mx::array(P, mx::int32);
      auto page = mx::reshape(mx::floor_divide(slots, Pa), {R, 1});
      auto off = mx::reshape(mx::remainder(slots, Pa), {R, 1});
      auto h = mx::reshape(mx::arange(0, kvh, 1, mx::int32), {1, kvh});
      WriteIndex w;
      if (on_cpu()) {
        auto flat = mx::add(mx::multiply(mx::add(mx::multiply(page, mx::array(kvh, mx::int32)), h), Pa), off);
        w.flat = mx::reshape(flat, {R * kvh, 1});
      } else {
        auto per_head = [R, kvh](const mx::array& a) {  // (R, 1) or (1, KVH) -> (R * KVH,)
          return mx::reshape(mx::broadcast_to(a, {R, kvh}), {R * kvh});
        };
        w.at = {per_head(page), per_head(h), per_head(off)};
      }
      writes_.emplace(gi, std::move(w));
    }
    const auto& w = writes_.at(gi);
    auto new_k = write_part(kbuf, k, w);
    auto new_v = write_part(value_storage(i), v, w);
    outputs_.push_back(new_k);
    outputs_.push_back(new_v);
    return {new_k, new_v};
  }

  // The gather index of group g, built once per forward from its tables and lengths.
  const Rows& rows(int g, int layer) {
    if (!rows_[g]) {
      const auto* in = group_inputs(g);
      const auto& kbuf = key_storage(layer);
      auto [read, mask] = paged_gather_index(in[0], in[1], windows_[layer], kbuf.shape(1), kbuf.shape(2));
      rows_[g] = Rows{read, mask};
    }
    return *rows_[g];
  }

  const DecodeStep::Graph& g_;
  const std::vector<int> windows_;  // per buffer (KV-owning layer): 0 = global
  const std::vector<int>& layer_groups_;
  const int num_groups_;
  const bool kernel_;
  const std::vector<mx::array>& inputs_;
  std::vector<mx::array>& outputs_;
  std::string* backend_;  // set to what the layers' attention ran on ("cpu", "cuda", "gather")
  std::vector<std::optional<Rows>> rows_;
  std::map<int, WriteIndex> writes_;  // per group: where write_part writes
};

std::vector<mx::array> paged_forward(const DecodeStep::Graph& g, const std::vector<int>& layer_groups,
                                     int num_groups, bool kernel, const std::vector<mx::array>& inputs,
                                     std::string* backend, const LoraLayout* lora) {
  // Adapter arrays (slots, then the layout's) follow the storage: kStepInputs, groups, 2 per buffer.
  LoraScope scope(lora, &inputs, kStepInputs + kGroupInputs * num_groups + 2 * num_buffers(g));
  std::vector<mx::array> outputs;
  outputs.reserve(1 + 2 * num_buffers(g));
  outputs.push_back(mx::array(0));  // logits, set below
  PagedKV kv(g, layer_groups, num_groups, kernel, inputs, outputs, backend);
  outputs[0] = layers_forward(g, inputs[0], inputs[1], kv, inputs[2], inputs[3]);
  return outputs;
}

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[PagedDecodeStep] " + what);
}

std::string shape_str(const mx::array& a) {
  return shape_text(a.shape());
}

// An integer (B,) array as int32, or a clear error.
mx::array row_ints(const mx::array& a, int B, const std::string& name) {
  if (a.size() != static_cast<size_t>(B) || a.ndim() > 2 || !mx::issubdtype(a.dtype(), mx::integer)) {
    fail(name + " must hold " + std::to_string(B) + " integers (one per row), got shape " + shape_str(a) +
         ".");
  }
  return a.dtype() == mx::int32 && a.ndim() == 1 ? a : mx::astype(mx::reshape(a, {B}), mx::int32);
}

int round_up(int n, int step) {
  return ((n + step - 1) / step) * step;
}

// Compiled: the row count a step of n rows runs at (see PagedDecodeConfig::pad_rows).
int row_bucket(int n) {
  if (n <= 16) {
    int b = 1;
    while (b < n) b *= 2;
    return b;
  }
  return round_up(n, 16);
}

// Whether some layer's RoPE is LongRoPE, whose table each row's call end picks.
bool uses_call_ends(const DecodeStep::Graph& g) {
  for (const auto& lw : g.layers) {
    if (lw.rope.long_freqs) return true;
  }
  return false;
}

// ``a`` (n, ...) with ``pad`` more rows of ``value`` at the end.
mx::array pad_rows(const mx::array& a, int pad, int value) {
  if (pad == 0) return a;
  std::vector<std::pair<int, int>> width(a.ndim(), {0, 0});
  width[0] = {0, pad};
  return mx::pad(a, width, mx::array(value, a.dtype()));
}

}  // namespace

PagedDecodeStep::PagedDecodeStep(
    DecodeConfig config,
    PagedDecodeConfig paged,
    const std::unordered_map<std::string, mx::array>& weights,
    const std::unordered_map<std::string, QuantSpec>& quantization)
    : paged_(std::move(paged)) {
  validate_decode_config(config);
  const int buffers = static_cast<int>(kv_layers(config).size());  // KV-shared layers have no storage
  if (static_cast<int>(paged_.layer_groups.size()) != buffers) {
    fail("layer_groups needs one entry per KV-owning layer, got " + std::to_string(paged_.layer_groups.size()) +
         " for " + std::to_string(buffers) + " layers.");
  }
  for (int g : paged_.layer_groups) {
    if (g < 0) fail("layer_groups entries must be >= 0.");
    num_groups_ = std::max(num_groups_, g + 1);
  }
  for (int g = 0; g < num_groups_; ++g) {
    if (std::find(paged_.layer_groups.begin(), paged_.layer_groups.end(), g) == paged_.layer_groups.end()) {
      fail("layer_groups must number the groups 0..G-1 with none unused; group " + std::to_string(g) +
           " has no layer.");
    }
  }
  // A group is one window and one page table: every buffer (KV-owning layer) of a group has its window.
  const auto owners = kv_layers(config);
  for (size_t b = 0; b < owners.size(); ++b) {
    const size_t first = static_cast<size_t>(
        std::find(paged_.layer_groups.begin(), paged_.layer_groups.end(), paged_.layer_groups[b]) -
        paged_.layer_groups.begin());
    const int wa = config.windows[owners[first]], wb = config.windows[owners[b]];
    if (wa != wb) {
      fail("layers " + std::to_string(owners[first]) + " and " + std::to_string(owners[b]) + " share layer group " +
           std::to_string(paged_.layer_groups[b]) + " but not a window (" + std::to_string(wa) + " vs " +
           std::to_string(wb) + "): a group is one window and one page table.");
    }
  }
  if (paged_.t_bucket < 1) fail("t_bucket must be >= 1.");
  if (paged_.attention != "kernel" && paged_.attention != "gather") {
    fail("attention must be \"kernel\" or \"gather\", got \"" + paged_.attention + "\".");
  }
  graph_ = std::make_shared<DecodeStep::Graph>();
  graph_->cfg = std::move(config);
  load_graph_weights(*graph_, weights, quantization);
  call_ends_ = uses_call_ends(*graph_);
  for (const auto& b : buffer_geometry(*graph_)) max_kv_heads_ = std::max(max_kv_heads_, b.kv_heads);
  compiled_ = compile_forward(nullptr);
}

void PagedDecodeStep::compile_step() {
  compiled_lora_ = lora_ ? compile_forward(lora_) : nullptr;
  std::erase_if(seen_, [](const std::vector<int>& sig) { return sig.back() == 1; });  // the old layout's
}

// One compiled function per adapter layout (see DecodeStep::compile_forward).
std::function<std::vector<mx::array>(const std::vector<mx::array>&)> PagedDecodeStep::compile_forward(
    std::shared_ptr<const LoraLayout> lora) const {
  if (!paged_.compile) {
    return nullptr;
  }
  auto g = graph_;
  auto groups = paged_.layer_groups;
  int G = num_groups_;
  bool kernel = paged_.attention == "kernel";
  auto backend = backend_;
  return mx::compile(
      [g, groups, G, kernel, backend, lora](const std::vector<mx::array>& in) {
        if (!in.empty() && in[0].is_tracer()) {
          g->traces += 1;  // runs only while tracing
        }
        return paged_forward(*g, groups, G, kernel, in, backend.get(), lora.get());
      },
      /*shapeless=*/false);
}

void PagedDecodeStep::set_adapters(const LoraInputs& adapters) {
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

PagedDecodeStep::~PagedDecodeStep() = default;

const DecodeConfig& PagedDecodeStep::config() const {
  return graph_->cfg;
}

int PagedDecodeStep::traces() const {
  return graph_->traces;
}

PagedStepOutput PagedDecodeStep::step(
    const mx::array& tokens,
    const mx::array& positions,
    const mx::array& logit_rows,
    const std::vector<PagedGroupInputs>& groups,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const std::optional<mx::array>& adapter_slots,
    const std::optional<mx::array>& call_ends) {
  const auto geometry = buffer_geometry(*graph_);  // per KV-owning layer
  const int L = static_cast<int>(geometry.size());
  if (tokens.ndim() > 2 || tokens.size() < 1 || !mx::issubdtype(tokens.dtype(), mx::integer)) {
    fail("tokens must be (R,) integer ids, got shape " + shape_str(tokens) + ".");
  }
  const int R = static_cast<int>(tokens.size());
  if (static_cast<int>(groups.size()) != num_groups_) {
    fail("expected " + std::to_string(num_groups_) + " layer groups of (block_tables, lengths, write_slots), got " +
         std::to_string(groups.size()) + ".");
  }
  if (static_cast<int>(keys.size()) != L || static_cast<int>(values.size()) != L) {
    fail("expected " + std::to_string(L) + " key and value storage arrays (one per layer, KV-shared layers excepted), got " +
         std::to_string(keys.size()) + " and " + std::to_string(values.size()) + ".");
  }
  if (logit_rows.ndim() != 1 || logit_rows.size() < 1 || !mx::issubdtype(logit_rows.dtype(), mx::integer)) {
    fail("logit_rows must be (M,) integer row indices with M >= 1, got shape " + shape_str(logit_rows) + ".");
  }
  const int M = logit_rows.shape(0);

  // Compiled: rows padded to a bucket (padding: token 0 at position 0, the null page's slot 0
  // written and read, no logits), so a batch that grows or shrinks by a row rarely retraces.
  const bool pad = compiled_ && paged_.pad_rows;
  const int R_run = pad ? row_bucket(R) : R, M_run = pad ? row_bucket(M) : M;
  std::vector<mx::array> inputs;
  inputs.reserve(kStepInputs + kGroupInputs * num_groups_ + 2 * L);
  inputs.push_back(pad_rows(row_ints(tokens, R, "tokens"), R_run - R, 0));
  inputs.push_back(pad_rows(row_ints(positions, R, "positions"), R_run - R, 0));
  inputs.push_back(pad_rows(logit_rows.dtype() == mx::int32 ? logit_rows : mx::astype(logit_rows, mx::int32),
                            M_run - M, 0));
  // Each row's call end (LongRoPE's table); without the plan's, every row is a call of its own. A graph
  // without LongRoPE never reads it: positions stand in (no op, no padding a step).
  if (!call_ends_) {
    inputs.push_back(inputs[1]);
  } else {
    inputs.push_back(call_ends ? pad_rows(row_ints(*call_ends, R, "call_ends"), R_run - R, 1)
                              : mx::add(inputs[1], mx::array(1, mx::int32)));  // (R_run,)
  }
  // The attention kernel's split counters: zeros, one per row and KV head (paged_attention's split_counts).
  const size_t counters = static_cast<size_t>(R_run) * static_cast<size_t>(max_kv_heads_);
  if (!split_counts_ || split_counts_->size() < counters) {
    size_t cap = 1024;
    while (cap < counters) cap *= 2;
    split_counts_ = mx::zeros({static_cast<int>(cap)}, mx::int32);
    mx::eval(*split_counts_);  // a constant of the step: the kernels set every count back to zero
  }
  inputs.push_back(*split_counts_);
  std::vector<int> signature{R_run, M_run, static_cast<int>(split_counts_->size())};
  for (int g = 0; g < num_groups_; ++g) {
    const auto& in = groups[g];
    const std::string where = "group " + std::to_string(g) + ": ";
    if (in.block_tables.ndim() != 2 || in.block_tables.shape(0) != R || in.block_tables.shape(1) < 1 ||
        !mx::issubdtype(in.block_tables.dtype(), mx::integer)) {
      fail(where + "block_tables must be (R, T) integer page ids with R = " + std::to_string(R) +
           " and T >= 1, got " + shape_str(in.block_tables) + ".");
    }
    auto tables = in.block_tables.dtype() == mx::int32 ? in.block_tables : mx::astype(in.block_tables, mx::int32);
    const int T = tables.shape(1);
    if (compiled_) {
      // Padding is the null page, never read (lengths bound the reads): T changes only per bucket.
      const int pad = round_up(T, paged_.t_bucket) - T;
      if (pad > 0) {
        tables = mx::pad(tables, std::vector<std::pair<int, int>>{{0, 0}, {0, pad}}, mx::array(0, mx::int32));
      }
    }
    signature.push_back(tables.shape(1));
    inputs.push_back(pad_rows(tables, R_run - R, 0));
    inputs.push_back(pad_rows(row_ints(in.lengths, R, where + "lengths"), R_run - R, 1));
    inputs.push_back(pad_rows(row_ints(in.write_slots, R, where + "write_slots"), R_run - R, 0));
  }
  for (int i = 0; i < L; ++i) {
    for (const auto* a : {&keys[i], &values[i]}) {
      if (!mx::issubdtype(a->dtype(), mx::floating)) {
        fail("layer " + std::to_string(i) + ": storage must be float16, bfloat16 or float32; quantized "
             "KV storage has no compiled paged step (decode it eagerly).");
      }
      const auto& b = geometry[i];
      const int width = a == &keys[i] ? b.head_dim : b.value_dim;
      if (a->ndim() != 4 || a->shape(1) != b.kv_heads || a->shape(3) != width) {
        fail("layer " + std::to_string(i) + ": " + (a == &keys[i] ? "key" : "value") + " storage must be (pages, " +
             std::to_string(b.kv_heads) + ", page_size, " + std::to_string(width) + "), got " +
             shape_text(a->shape()) + ".");
      }
    }
    if (keys[i].shape(0) != values[i].shape(0) || keys[i].shape(2) != values[i].shape(2) ||
        keys[i].dtype() != values[i].dtype()) {
      fail("layer " + std::to_string(i) + ": keys and values storage differ in pages, page size or dtype.");
    }
    signature.insert(signature.end(), {keys[i].shape(0), keys[i].shape(2),
                                       static_cast<int>(keys[i].dtype().val())});
    inputs.push_back(keys[i]);
    inputs.push_back(values[i]);
  }

  // Without slots no row has an adapter: the step runs without the update (nothing to pay).
  const bool adapted = lora_ && adapter_slots.has_value();
  if (adapted) {
    inputs.push_back(pad_rows(lora_slots(adapter_slots, R, "PagedDecodeStep.step"), R_run - R, 0));
    inputs.insert(inputs.end(), lora_arrays_.begin(), lora_arrays_.end());
    for (const auto& a : lora_arrays_) {
      signature.insert(signature.end(), a.shape().begin(), a.shape().end());
    }
  }
  signature.push_back(adapted ? 1 : 0);  // last: which compiled function (compile_step drops the old 1s)

  std::vector<mx::array> outputs;
  const auto& compiled = adapted ? compiled_lora_ : compiled_;
  if (compiled) {
    const bool known = seen_.count(signature) > 0;
    const int before = graph_->traces;
    outputs = compiled(inputs);
    if (known && graph_->traces > before) {
      retraces_ += 1;
    }
    seen_.insert(std::move(signature));
  } else {
    outputs = paged_forward(*graph_, paged_.layer_groups, num_groups_, paged_.attention == "kernel", inputs,
                            backend_.get(), adapted ? lora_.get() : nullptr);
  }
  inputs.clear();  // the graph holds the storage now; the caller's commit drops its own reference

  auto logits = M_run == M ? outputs[0] : mx::slice(outputs[0], {0, 0}, {M, outputs[0].shape(1)});
  PagedStepOutput out{logits, {}, {}};
  out.keys.reserve(L);
  out.values.reserve(L);
  for (int i = 0; i < L; ++i) {
    out.keys.push_back(outputs[1 + 2 * i]);
    out.values.push_back(outputs[2 + 2 * i]);
  }
  steps_ += 1;
  return out;
}

}  // namespace mlx_infer
