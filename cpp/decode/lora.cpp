// Adapters inside a step's forward (see mlx_infer/lora.h for the math and shapes).
#include "lora.h"
#include "mlx_infer/text.h"

#include <numeric>
#include <stdexcept>

#include "graph.h"
#include "mlx_infer/matmul.h"

namespace mlx_infer {

namespace {

// One group's dense update of one input: the whole (B, L, sum of outs) and its part per member.
struct GroupUpdate {
  std::uintptr_t input = 0;  // the input's id
  mx::array whole = mx::array(0);
  std::vector<mx::array> parts;
};

struct Active {
  const LoraLayout* layout = nullptr;
  const std::vector<mx::array>* inputs = nullptr;
  int start = 0;
  // The dense product's slot masks (B, 1, width), built once per forward, width and dtype.
  std::vector<std::pair<std::pair<int, mx::Dtype>, mx::array>> masks;
  // A group's update, built by its first member's call (or once for a fused linear).
  std::unordered_map<int, GroupUpdate> groups;
};

// The forward being built on this thread (a step's forward runs synchronously, tracing included).
thread_local Active active;

// (B, 1, width): 1 on the columns of each row's slot; column c belongs to slot (c mod S r) / r.
mx::array slot_mask(Active& act, const mx::array& slots, int S, int r, int width, mx::Dtype dtype) {
  const std::pair<int, mx::Dtype> key{width, dtype};
  for (const auto& [k, m] : act.masks) {
    if (k == key) return m;
  }
  auto c = mx::arange(0, width, 1, mx::int32);
  auto cols = mx::floor_divide(mx::remainder(c, mx::array(S * r, mx::int32)), mx::array(r, mx::int32));
  auto m = mx::astype(mx::equal(mx::expand_dims(slots, 1), mx::expand_dims(cols, 0)), dtype);  // (B, width)
  m = mx::expand_dims(m, 1);
  act.masks.emplace_back(key, m);
  return m;
}

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[adapters] " + what);
}

std::string shape_str(const mx::array& a) {
  return shape_text(a.shape());
}

std::vector<std::string> members_of(const std::string& target) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t plus = target.find('+', start);
    out.push_back(target.substr(start, plus - start));
    if (plus == std::string::npos) break;
    start = plus + 1;
  }
  return out;
}

}  // namespace

std::shared_ptr<const LoraLayout> make_lora_layout(const LoraInputs& in,
                                                   const std::unordered_map<std::string, int>& outs) {
  const size_t n = in.targets.size();
  if (in.a.size() != n || in.b.size() != n || in.scales.size() != n || in.g.size() != n) {
    fail("targets, a, b, scales and g need one entry per target.");
  }
  auto layout = std::make_shared<LoraLayout>();
  int idx = 1;  // 0: slots
  int S = -1;
  for (size_t i = 0; i < n; ++i) {
    const auto& target = in.targets[i];
    const auto members = members_of(target);
    int out = 0;
    for (const auto& m : members) {
      auto it = outs.find(m);
      if (it == outs.end()) {
        fail("the step has no linear named '" + m + "' (it runs layers.i.{q,k,v,o,gate,up,down}, a q|k|v or "
             "gate|up it fuses by its members' names, layers.i.{qkv,gate_up} where the checkpoint fuses them, "
             "and DeepSeek V3's layers.i.{q_a,q_b,kv_a,shared.gate,shared.up,shared.down}).");
      }
      out += it->second;
    }
    const auto &a = in.a[i], &b = in.b[i], &s = in.scales[i];
    if (s.ndim() != 1) fail(target + ": scales must be (S,), got " + shape_str(s) + ".");
    if (S == -1) S = s.shape(0);
    if (s.shape(0) != S) fail(target + ": every target needs the same slot count S.");
    const int k = static_cast<int>(members.size());
    const bool gathered = k == 1 && a.ndim() == 3 && b.ndim() == 3 && a.shape(0) == S && b.shape(0) == S &&
                          a.shape(2) == b.shape(1) && b.shape(2) == out;
    const bool dense = a.ndim() == 2 && b.ndim() == 2 && a.shape(0) == b.shape(1) && a.shape(0) % (S * k) == 0 &&
                       b.shape(0) == out;
    if (!gathered && !dense) {
      fail(target + ": a and b must be (S, in, r) and (S, r, out), or (S r, in) and (out, S r) (a group of k "
           "linears sharing an input: (k S r, in) and (sum of outs, k S r)) with S = " + std::to_string(S) +
           ", got " + shape_str(a) + " and " + shape_str(b) + ".");
    }
    if (in.g[i] && (k > 1 || in.g[i]->ndim() != 2 || in.g[i]->shape(0) != S || in.g[i]->shape(1) != out)) {
      fail(target + ": g must be (S, out), and a group takes none.");
    }
    LoraLayout::Entry e{idx, idx + 1, idx + 2, -1, -1, 0};
    idx += 3;
    if (in.g[i]) e.g = idx++;
    if (k > 1) {
      LoraLayout::Group grp;
      for (const auto& m : members) grp.outs.push_back(outs.at(m));
      grp.members = k;
      e.group = static_cast<int>(layout->groups.size());
      layout->groups.push_back(std::move(grp));
    }
    for (int p = 0; p < k; ++p) {
      e.part = p;
      if (!layout->entries.emplace(members[p], e).second) fail("linear '" + members[p] + "' is given twice.");
    }
    layout->key += target + (in.g[i] ? "+g;" : ";") + (dense ? "d;" : "s;");
  }
  // A fused linear is targeted by its own name or by its members', never both (one update per row).
  for (const auto& [name, _] : layout->entries) {
    const auto dot = name.rfind('.');
    const auto tail = name.substr(dot + 1);
    if (tail != "qkv" && tail != "gate_up") continue;
    for (const auto* m : tail == "qkv" ? std::vector<const char*>{"q", "k", "v"}
                                       : std::vector<const char*>{"gate", "up"}) {
      const auto member = name.substr(0, dot + 1) + m;
      if (layout->entries.count(member)) {
        fail("'" + name + "' and its member '" + member + "' are both targeted: give the fused linear's "
             "update or its members', not both.");
      }
    }
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
  active = Active{layout, inputs, start, {}, {}};
}

LoraScope::~LoraScope() {
  active = Active{};
}

namespace {

// The dense update (B, L, width of b) of x under a (rows, in), b (out, rows); k members share it.
mx::array dense_update(const Linear& l, const mx::array& x3, const mx::array& A, const mx::array& Bm,
                       const mx::array& slots, int S, int k) {
  // A and B are linear weights: on the CPU kernels when the layer is.
  // In the promoted dtype, as ``x @ a`` promotes (a bfloat16 model's float32 adapter: float32).
  auto product = [&l](const mx::array& v, const mx::array& w) {
    if (!l.fast) return mx::matmul(v, mx::transpose(w));
    const auto dt = mx::promote_types(v.dtype(), w.dtype());
    return fast_linear(mx::astype(v, dt), mx::astype(w, dt), std::nullopt);
  };
  const int rows = A.shape(0);
  auto xa = product(x3, A);  // (B, L, k S r)
  xa = mx::multiply(xa, slot_mask(active, slots, S, rows / (S * k), rows, xa.dtype()));
  return product(xa, Bm);  // (B, L, sum of outs): scales are in B
}

// y = base(x) + update on the CPU kernels (fast_lora_update): one op per linear, a group's
// member reading its own columns of the stacked A and its rows of the block-diagonal B.
mx::array fused_update(const Linear& l, const mx::array& x, const mx::array& x3, const mx::array& A,
                       const mx::array& Bm, const mx::array& slots, int S, const LoraLayout::Entry& e,
                       const mx::array* g) {
  int k = 1, col0 = 0, row0 = 0;
  if (e.group >= 0) {
    const auto& grp = active.layout->groups[e.group];
    k = grp.members;
    for (int p = 0; p < e.part; ++p) row0 += grp.outs[p];
  }
  const int r = A.shape(0) / (S * k);
  col0 = e.part * S * r;
  mx::array y(0);
  if (g == nullptr && !l.quantized()) {  // the product, the update and the add: one op
    y = fast_lora_linear(x3, *l.w, l.bias, A, Bm, slots, S, r, col0, row0);  // (B, L, out)
  } else if (g == nullptr && l.mode == "affine" && !l.bias) {
    y = fast_lora_quantized_matmul(x3, *l.w, *l.scales, l.biases, l.group_size, l.bits, A, Bm, slots, S, r, col0,
                                   row0);  // (B, L, out)
  } else if (g == nullptr) {
    y = fast_lora_update(base_linear(l, x3), x3, A, Bm, slots, S, r, col0, row0);  // (B, L, out)
  } else {  // DoRA: g[slots] * (x W^T + delta) + bias
    Linear nobias = l;
    nobias.bias.reset();
    auto gs = mx::astype(mx::expand_dims(mx::take(*g, slots, 0), 1), x.dtype());  // (B, 1, out)
    y = mx::multiply(gs, fast_lora_update(base_linear(nobias, x3), x3, A, Bm, slots, S, r, col0, row0));
    if (l.bias) y = mx::add(y, *l.bias);
  }
  auto shape = x.shape();
  shape.back() = y.shape(-1);
  return mx::reshape(y, shape);
}

}  // namespace

namespace {

// e's group's dense update of x, built once per input and group.
const GroupUpdate& group_update(const Linear& l, const mx::array& x, const mx::array& x3,
                                const LoraLayout::Entry& e) {
  const auto& in = *active.inputs;
  const int s0 = active.start;
  const auto& grp = active.layout->groups[e.group];
  const auto key = reinterpret_cast<std::uintptr_t>(x.id());
  auto found = active.groups.find(e.group);
  if (found == active.groups.end() || found->second.input != key) {
    const int S = in[s0 + e.scales].shape(0);
    GroupUpdate u;
    u.input = key;
    u.whole = dense_update(l, x3, in[s0 + e.a], in[s0 + e.b], in[s0], S, grp.members);  // (B, L, sum of outs)
    std::vector<int> cuts;
    int at = 0;
    for (size_t p = 0; p + 1 < grp.outs.size(); ++p) cuts.push_back(at += grp.outs[p]);
    u.parts = mx::split(u.whole, mx::Shape(cuts.begin(), cuts.end()), -1);  // slices: free where unused
    found = active.groups.insert_or_assign(e.group, std::move(u)).first;
  }
  return found->second;
}

// The update of the linear ``e`` targets (B, L, out), in x's dtype; ``l`` runs its products (a
// fused linear for its members: they share its kind).
mx::array member_delta(const Linear& l, const mx::array& x, const mx::array& x3, const LoraLayout::Entry& e) {
  const auto& in = *active.inputs;
  const int s0 = active.start;
  const auto& slots = in[s0];
  const auto& A = in[s0 + e.a];
  const auto& Bm = in[s0 + e.b];
  const int S = in[s0 + e.scales].shape(0);
  const int B = x3.shape(0);
  if (e.group >= 0) {  // linears sharing this input: one update for all, split by member
    return mx::astype(group_update(l, x, x3, e).parts[e.part], x.dtype());
  }
  if (A.ndim() == 2) {  // dense: every slot's columns at once, the others masked
    return mx::astype(dense_update(l, x3, A, Bm, slots, S, 1), x.dtype());
  }
  auto xa = mx::gather_mm(x3, A, std::nullopt, slots);                    // (B, L, r)
  auto z = mx::gather_mm(xa, Bm, std::nullopt, slots);                    // (B, L, out)
  auto s = mx::reshape(mx::take(in[s0 + e.scales], slots, 0), {B, 1, 1});  // (B, 1, 1)
  return mx::astype(mx::multiply(s, z), x.dtype());
}

// y = base(x) + delta, or DoRA's g * (x W^T + delta) + bias where ``g`` (B, 1, out) is given.
mx::array adapted(const Linear& l, const mx::array& x, const mx::array& x3, const mx::array& delta,
                  const std::optional<mx::array>& g) {
  mx::array y(0);
  if (!g) {
    y = mx::add(base_linear(l, x3), delta);
  } else {
    Linear nobias = l;
    nobias.bias.reset();
    y = mx::multiply(*g, mx::add(base_linear(nobias, x3), delta));
    if (l.bias) y = mx::add(y, *l.bias);
  }
  auto shape = x.shape();
  shape.back() = y.shape(-1);
  return mx::reshape(y, shape);
}

// DoRA's g[slots] (B, 1, out) of ``e``, in x's dtype.
mx::array dora_gain(const LoraLayout::Entry& e, const mx::array& x) {
  const auto& in = *active.inputs;
  return mx::astype(mx::expand_dims(mx::take(in[active.start + e.g], in[active.start], 0), 1), x.dtype());
}

// A fused linear (q|k|v, gate|up) whose members the layout targets: one product over the fused
// weights and one add of every member's update, concatenated by output row in member order (zeros
// for members no adapter targets; a group covering all members in order is the update as it is).
// Per member the same ops as the member's own linear, so its rows are what the unfused step gives.
std::optional<mx::array> fused_lora_linear(const Linear& l, const mx::array& x) {
  const auto& entries = active.layout->entries;
  std::vector<const LoraLayout::Entry*> es;
  bool any = false, dora = false;
  for (const auto& [name, rows] : l.members) {
    auto it = entries.find(name);
    es.push_back(it == entries.end() ? nullptr : &it->second);
    any = any || es.back() != nullptr;
    dora = dora || (es.back() != nullptr && es.back()->g >= 0);
  }
  if (!any) return std::nullopt;
  const int B = x.shape(0);
  auto x3 = mx::reshape(x, {B, -1, x.shape(-1)});  // (B, L, in)
  const int L = x3.shape(1);
  const int n = static_cast<int>(es.size());
  bool whole = es[0] != nullptr && es[0]->group >= 0 && active.layout->groups[es[0]->group].members == n;
  for (int p = 0; whole && p < n; ++p) {
    whole = es[p] != nullptr && es[p]->group == es[0]->group && es[p]->part == p;
  }
  mx::array delta(0);
  if (whole) {
    delta = mx::astype(group_update(l, x, x3, *es[0]).whole, x.dtype());  // (B, L, sum of outs)
  } else {
    std::vector<mx::array> parts;
    for (int p = 0; p < n; ++p) {
      parts.push_back(es[p] != nullptr ? member_delta(l, x, x3, *es[p])
                                       : mx::zeros({B, L, l.members[p].second}, x.dtype()));  // (B, L, out_p)
    }
    delta = mx::concatenate(parts, -1);  // (B, L, sum of outs)
  }
  std::optional<mx::array> g;
  if (dora) {  // the DoRA members' gains, 1 on the others' rows
    std::vector<mx::array> gains;
    for (int p = 0; p < n; ++p) {
      gains.push_back(es[p] != nullptr && es[p]->g >= 0 ? dora_gain(*es[p], x)
                                                        : mx::ones({B, 1, l.members[p].second}, x.dtype()));
    }
    g = mx::concatenate(gains, -1);  // (B, 1, sum of outs)
  }
  return adapted(l, x, x3, delta, g);
}

}  // namespace

std::optional<mx::array> lora_linear(const Linear& l, const mx::array& x) {
  if (active.layout == nullptr) return std::nullopt;
  auto it = l.name.empty() ? active.layout->entries.end() : active.layout->entries.find(l.name);
  if (it == active.layout->entries.end()) {
    return l.members.empty() ? std::nullopt : fused_lora_linear(l, x);
  }
  const auto& in = *active.inputs;
  const int s0 = active.start;
  const auto& e = it->second;
  const auto& A = in[s0 + e.a];
  const int B = x.shape(0);
  auto x3 = mx::reshape(x, {B, -1, x.shape(-1)});  // (B, L, in)
  if (l.fast && A.ndim() == 2) {  // the CPU kernels: the update and its add in one op (matmul.h)
    const int S = in[s0 + e.scales].shape(0);
    return fused_update(l, x, x3, A, in[s0 + e.b], in[s0], S, e, e.g >= 0 ? &in[s0 + e.g] : nullptr);
  }
  auto delta = member_delta(l, x, x3, e);
  return adapted(l, x, x3, delta, e.g >= 0 ? std::optional<mx::array>(dora_gain(e, x)) : std::nullopt);
}

}  // namespace mlx_infer
