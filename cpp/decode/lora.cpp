// Adapters inside a step's forward (see mlx_infer/lora.h for the math and shapes).
#include "lora.h"

#include <sstream>
#include <stdexcept>

#include "graph.h"

namespace mlx_infer {

namespace {

struct Active {
  const LoraLayout* layout = nullptr;
  const std::vector<mx::array>* inputs = nullptr;
  int start = 0;
};

// The forward being built on this thread (a step's forward runs synchronously, tracing included).
thread_local Active active;

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[adapters] " + what);
}

std::string shape_str(const mx::array& a) {
  std::ostringstream s;
  s << a.shape();
  return s.str();
}

}  // namespace

std::shared_ptr<const LoraLayout> make_lora_layout(const LoraInputs& in,
                                                   const std::unordered_set<std::string>& names) {
  const size_t n = in.targets.size();
  if (in.a.size() != n || in.b.size() != n || in.scales.size() != n || in.g.size() != n) {
    fail("targets, a, b, scales and g need one entry per target.");
  }
  auto layout = std::make_shared<LoraLayout>();
  int idx = 1;  // 0: slots
  int S = -1;
  for (size_t i = 0; i < n; ++i) {
    const auto& name = in.targets[i];
    if (!names.count(name)) {
      fail("the step has no linear named '" + name + "' (fused projections take no adapter: turn "
           "fuse_projections off).");
    }
    const auto &a = in.a[i], &b = in.b[i], &s = in.scales[i];
    if (a.ndim() != 3 || b.ndim() != 3 || a.shape(0) != b.shape(0) || a.shape(2) != b.shape(1)) {
      fail(name + ": a must be (S, in, r) and b (S, r, out), got " + shape_str(a) + " and " + shape_str(b) + ".");
    }
    if (S == -1) S = a.shape(0);
    if (a.shape(0) != S || s.ndim() != 1 || s.shape(0) != S) {
      fail(name + ": every target needs the same slot count S and scales (S,), got " + shape_str(s) + ".");
    }
    if (in.g[i] && (in.g[i]->ndim() != 2 || in.g[i]->shape(0) != S || in.g[i]->shape(1) != b.shape(2))) {
      fail(name + ": g must be (S, out), got " + shape_str(*in.g[i]) + ".");
    }
    LoraLayout::Entry e{idx, idx + 1, idx + 2, -1};
    idx += 3;
    if (in.g[i]) e.g = idx++;
    if (!layout->entries.emplace(name, e).second) fail("target '" + name + "' is given twice.");
    layout->key += name + (in.g[i] ? "+g;" : ";");
  }
  layout->count = idx;
  return layout;
}

std::vector<mx::array> lora_arrays(const LoraInputs& in) {
  std::vector<mx::array> out;
  for (size_t i = 0; i < in.targets.size(); ++i) {
    out.push_back(in.a[i]);
    out.push_back(in.b[i]);
    out.push_back(mx::astype(in.scales[i], mx::float32));
    if (in.g[i]) out.push_back(*in.g[i]);
  }
  return out;
}

mx::array lora_slots(const std::optional<mx::array>& slots, int B, const std::string& where) {
  if (!slots) return mx::zeros({B}, mx::int32);
  const auto& s = *slots;
  if (s.size() != static_cast<size_t>(B) || s.ndim() > 1 || !mx::issubdtype(s.dtype(), mx::integer)) {
    throw std::invalid_argument("[" + where + "] adapter_slots must hold " + std::to_string(B) +
                                " integers (one bank slot per row), got shape " + shape_str(s) + ".");
  }
  return s.dtype() == mx::int32 ? mx::reshape(s, {B}) : mx::astype(mx::reshape(s, {B}), mx::int32);
}

LoraScope::LoraScope(const LoraLayout* layout, const std::vector<mx::array>* inputs, int start) {
  active = Active{layout, inputs, start};
}

LoraScope::~LoraScope() {
  active = Active{};
}

std::optional<mx::array> lora_linear(const Linear& l, const mx::array& x) {
  if (active.layout == nullptr || l.name.empty()) return std::nullopt;
  auto it = active.layout->entries.find(l.name);
  if (it == active.layout->entries.end()) return std::nullopt;
  const auto& in = *active.inputs;
  const int s0 = active.start;
  const auto& e = it->second;
  const auto& slots = in[s0];
  const auto& A = in[s0 + e.a];
  const auto& Bm = in[s0 + e.b];
  const int B = x.shape(0);
  auto x3 = mx::reshape(x, {B, -1, x.shape(-1)});                         // (B, L, in)
  auto xa = mx::gather_mm(x3, A, std::nullopt, slots);                    // (B, L, r)
  auto z = mx::gather_mm(xa, Bm, std::nullopt, slots);                    // (B, L, out)
  auto s = mx::reshape(mx::take(in[s0 + e.scales], slots, 0), {B, 1, 1});  // (B, 1, 1)
  auto delta = mx::astype(mx::multiply(s, z), x.dtype());
  mx::array y(0);
  if (e.g < 0) {
    y = mx::add(base_linear(l, x3), delta);
  } else {
    Linear nobias = l;
    nobias.bias.reset();
    auto g = mx::astype(mx::expand_dims(mx::take(in[s0 + e.g], slots, 0), 1), x.dtype());  // (B, 1, out)
    y = mx::multiply(g, mx::add(base_linear(nobias, x3), delta));
    if (l.bias) y = mx::add(y, *l.bias);
  }
  auto shape = x.shape();
  shape.back() = y.shape(-1);
  return mx::reshape(y, shape);
}

}  // namespace mlx_infer
