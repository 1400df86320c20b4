// PagedDecodeStep: the decode step over a paged store's page arrays (see
// mlx_infer/paged_decode.h for the layout, the buckets and the commit rule).
#include "mlx_infer/paged_decode.h"

#include <algorithm>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "graph.h"

namespace mlx_infer {

namespace {

constexpr int kGroupInputs = 5;  // pages, offsets, mask, write_pages, write_offsets

// Scatter ``x`` (B, KVH, 1, D) at ``write`` rows of ``part`` viewed as
// (pages * KVH * page_size, D), then gather ``read`` rows (B, KVH, S) of the
// result: the same ops as the engine's eager paged path (engine/batch.py).
std::pair<mx::array, mx::array> write_read_part(const mx::array& part, const mx::array& x,
                                                const mx::array& write, const mx::array& read) {
  const auto shape = part.shape();  // (pages, KVH, P, D)
  const int D = shape[3];
  auto flat = mx::reshape(part, {-1, D});  // a view: the buffer MLX may update in place
  auto upd = mx::reshape(mx::astype(x, part.dtype()), {-1, D});  // (B * KVH, D)
  flat = mx::put_along_axis(flat, mx::broadcast_to(write, {write.shape(0), D}), upd, 0);
  return {mx::reshape(flat, shape), mx::take(flat, read, 0)};  // storage', (B, KVH, S, D)
}

// The pages of a store. Inputs: tokens, positions, G groups of kGroupInputs,
// then k_0, v_0, ..., k_{L-1}, v_{L-1}; each layer's updated storage is
// appended to ``outputs`` in that order.
class PagedKV final : public KVAccess {
 public:
  PagedKV(const std::vector<int>& layer_groups, int num_groups, const std::vector<mx::array>& inputs,
          std::vector<mx::array>& outputs)
      : layer_groups_(layer_groups), num_groups_(num_groups), inputs_(inputs), outputs_(outputs),
        rows_(num_groups) {}

  AttentionInputs write_read(int i, const mx::array& k, const mx::array& v) override {
    const int g = layer_groups_[i];
    const auto& kbuf = inputs_[2 + kGroupInputs * num_groups_ + 2 * i];
    const auto& vbuf = inputs_[3 + kGroupInputs * num_groups_ + 2 * i];
    const auto& r = rows(g, kbuf.shape(1), kbuf.shape(2));
    auto [new_k, keys] = write_read_part(kbuf, k, r.write, r.read);
    auto [new_v, values] = write_read_part(vbuf, v, r.write, r.read);
    outputs_.push_back(std::move(new_k));
    outputs_.push_back(std::move(new_v));
    return {keys, values, r.mask};
  }

 private:
  struct Rows {
    mx::array write;  // (B * KVH, 1)
    mx::array read;   // (B, KVH, S)
    mx::array mask;   // (B, 1, 1, S)
  };

  // Row indices of group g in the (pages * KVH * P, D) view, built once per forward.
  const Rows& rows(int g, int kvh, int page_size) {
    if (!rows_[g]) {
      const auto* in = &inputs_[2 + kGroupInputs * g];
      const auto &pages = in[0], &offsets = in[1], &mask = in[2], &wp = in[3], &wo = in[4];
      const int B = pages.shape(0), S = pages.shape(1);
      auto KVH = mx::array(kvh, mx::int32), P = mx::array(page_size, mx::int32);
      auto h = mx::arange(0, kvh, 1, mx::int32);
      // ((page * KVH + head) * P + offset)
      auto write = mx::add(mx::multiply(mx::add(mx::multiply(mx::reshape(wp, {B, 1}), KVH),
                                                mx::reshape(h, {1, kvh})), P),
                           mx::reshape(wo, {B, 1}));  // (B, KVH)
      auto read = mx::add(mx::multiply(mx::add(mx::multiply(mx::reshape(pages, {B, 1, S}), KVH),
                                               mx::reshape(h, {1, kvh, 1})), P),
                          mx::reshape(offsets, {B, 1, S}));  // (B, KVH, S)
      rows_[g] = Rows{mx::reshape(write, {B * kvh, 1}), read, mx::reshape(mask, {B, 1, 1, S})};
    }
    return *rows_[g];
  }

  const std::vector<int>& layer_groups_;
  const int num_groups_;
  const std::vector<mx::array>& inputs_;
  std::vector<mx::array>& outputs_;
  std::vector<std::optional<Rows>> rows_;
};

std::vector<mx::array> paged_forward(const DecodeStep::Graph& g, const std::vector<int>& layer_groups,
                                     int num_groups, const std::vector<mx::array>& inputs) {
  std::vector<mx::array> outputs;
  outputs.reserve(1 + 2 * num_buffers(g));
  outputs.push_back(mx::array(0));  // logits, set below
  PagedKV kv(layer_groups, num_groups, inputs, outputs);
  outputs[0] = layers_forward(g, inputs[0], inputs[1], kv);
  return outputs;
}

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[PagedDecodeStep] " + what);
}

std::string shape_str(const mx::array& a) {
  std::ostringstream s;
  s << a.shape();
  return s.str();
}

// An integer (B,) array as int32, or a clear error.
mx::array row_ints(const mx::array& a, int B, const std::string& name) {
  if (a.size() != static_cast<size_t>(B) || a.ndim() > 2 || !mx::issubdtype(a.dtype(), mx::integer)) {
    fail(name + " must hold " + std::to_string(B) + " integers (one per row), got shape " + shape_str(a) +
         ".");
  }
  return mx::astype(mx::reshape(a, {B}), mx::int32);
}

int round_up(int n, int step) {
  return ((n + step - 1) / step) * step;
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
  if (paged_.s_bucket < 1) fail("s_bucket must be >= 1.");
  graph_ = std::make_shared<DecodeStep::Graph>();
  graph_->cfg = std::move(config);
  load_graph_weights(*graph_, weights, quantization);
  if (paged_.compile) {
    auto g = graph_;
    auto groups = paged_.layer_groups;
    int G = num_groups_;
    compiled_ = mx::compile(
        [g, groups, G](const std::vector<mx::array>& in) {
          if (!in.empty() && in[0].is_tracer()) {
            g->traces += 1;  // runs only while tracing
          }
          return paged_forward(*g, groups, G, in);
        },
        /*shapeless=*/false);
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
    const std::vector<PagedGroupInputs>& groups,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values) {
  const auto geometry = buffer_geometry(*graph_);  // per KV-owning layer
  const int L = static_cast<int>(geometry.size());
  if (tokens.ndim() > 2 || tokens.size() < 1 || !mx::issubdtype(tokens.dtype(), mx::integer)) {
    fail("tokens must be (B,) integer ids, got shape " + shape_str(tokens) + ".");
  }
  const int B = static_cast<int>(tokens.size());
  if (static_cast<int>(groups.size()) != num_groups_) {
    fail("expected " + std::to_string(num_groups_) + " layer groups of gather inputs, got " +
         std::to_string(groups.size()) + ".");
  }
  if (static_cast<int>(keys.size()) != L || static_cast<int>(values.size()) != L) {
    fail("expected " + std::to_string(L) + " key and value storage arrays (one per layer, KV-shared layers excepted), got " +
         std::to_string(keys.size()) + " and " + std::to_string(values.size()) + ".");
  }

  std::vector<mx::array> inputs;
  inputs.reserve(2 + kGroupInputs * num_groups_ + 2 * L);
  inputs.push_back(row_ints(tokens, B, "tokens"));
  inputs.push_back(row_ints(positions, B, "positions"));
  std::vector<int> signature{B};
  for (int g = 0; g < num_groups_; ++g) {
    const auto& in = groups[g];
    const std::string where = "group " + std::to_string(g) + ": ";
    if (in.pages.ndim() != 2 || in.pages.shape(0) != B || in.offsets.shape() != in.pages.shape() ||
        in.mask.shape() != in.pages.shape()) {
      fail(where + "pages, offsets and mask must share one (B, S) shape with B = " + std::to_string(B) +
           ", got " + shape_str(in.pages) + ", " + shape_str(in.offsets) + ", " + shape_str(in.mask) + ".");
    }
    if (!mx::issubdtype(in.pages.dtype(), mx::integer) || !mx::issubdtype(in.offsets.dtype(), mx::integer)) {
      fail(where + "pages and offsets must be integer arrays.");
    }
    if (in.mask.dtype() != mx::bool_) fail(where + "mask must be a bool array.");
    auto pages = mx::astype(in.pages, mx::int32);
    auto offsets = mx::astype(in.offsets, mx::int32);
    auto mask = in.mask;
    const int S = pages.shape(1);
    if (compiled_) {
      // Padding reads slot 0 of the null page, masked out: S changes only per bucket.
      const int pad = round_up(S, paged_.s_bucket) - S;
      if (pad > 0) {
        std::vector<std::pair<int, int>> width{{0, 0}, {0, pad}};
        pages = mx::pad(pages, width, mx::array(0, mx::int32));
        offsets = mx::pad(offsets, width, mx::array(0, mx::int32));
        mask = mx::pad(mask, width, mx::array(false));
      }
    }
    signature.push_back(pages.shape(1));
    inputs.push_back(pages);
    inputs.push_back(offsets);
    inputs.push_back(mask);
    inputs.push_back(row_ints(in.write_pages, B, where + "write_pages"));
    inputs.push_back(row_ints(in.write_offsets, B, where + "write_offsets"));
  }
  for (int i = 0; i < L; ++i) {
    for (const auto* a : {&keys[i], &values[i]}) {
      if (!mx::issubdtype(a->dtype(), mx::floating)) {
        fail("layer " + std::to_string(i) + ": storage must be float16, bfloat16 or float32; quantized "
             "KV storage has no compiled paged step (decode it eagerly).");
      }
      const auto& b = geometry[i];
      if (a->ndim() != 4 || a->shape(1) != b.kv_heads || a->shape(3) != b.head_dim) {
        std::ostringstream msg;
        msg << "layer " << i << ": storage must be (pages, " << b.kv_heads << ", page_size, "
            << b.head_dim << "), got " << a->shape() << ".";
        fail(msg.str());
      }
    }
    if (keys[i].shape() != values[i].shape() || keys[i].dtype() != values[i].dtype()) {
      fail("layer " + std::to_string(i) + ": keys and values storage differ in shape or dtype.");
    }
    signature.insert(signature.end(), {keys[i].shape(0), keys[i].shape(2),
                                       static_cast<int>(keys[i].dtype().val())});
    inputs.push_back(keys[i]);
    inputs.push_back(values[i]);
  }

  std::vector<mx::array> outputs;
  if (compiled_) {
    const bool known = seen_.count(signature) > 0;
    const int before = graph_->traces;
    outputs = compiled_(inputs);
    if (known && graph_->traces > before) {
      retraces_ += 1;
    }
    seen_.insert(std::move(signature));
  } else {
    outputs = paged_forward(*graph_, paged_.layer_groups, num_groups_, inputs);
  }
  inputs.clear();  // the graph holds the storage now; the caller's commit drops its own reference

  PagedStepOutput out{outputs[0], {}, {}};
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
