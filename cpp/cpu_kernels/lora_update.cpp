// The per-row low-rank (LoRA) update of one linear in one call (issue 21):
//
//   out[b, l, n] = base[b, l, n] + sum_{j in cols(s_b)} (x[b, l] . a[j]) * w_b[row0 + n, j]
//   cols(s) = [col0 + s r, col0 + (s + 1) r),  s_b = slots[b]
//
// a (rows, K) and w_b (N_all, rows) are the bank's concatenated A^T / scaled B^T (linear
// weights, adapters/bank.py's a_cat / b_cat, or a group's stacked A and block-diagonal B:
// adapters/native.py). A row whose slot is 0 (no adapter) or outside [1, S) is copied
// through. Both products accumulate in float32 and the sum rounds once to base's dtype.
//
// MLX's graph of the same update is six ops or more (two matmuls, the slot mask and its
// multiply, a split for groups, the cast and the add); at decode shapes their dispatch, not
// their arithmetic, was a third of a step (RESULTS.md, LoRA).
#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include <algorithm>
#include <optional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "array_util.h"
#include "elem.h"
#include "kernels.h"
#include "mlx_infer/matmul.h"
#include "threadpool.h"

namespace mlx_infer {

namespace {

using namespace detail;
using cpu::ElemType;

struct LoraGeom {
  int64_t M;      // rows of x (B L)
  int64_t L;      // rows per slot entry
  int64_t K;      // input width
  int64_t N;      // output width (base)
  int64_t rows;   // rows of a == columns of w_b
  int64_t row0;   // first row of w_b for this output
  int64_t col0;   // first column of slot 0
  int64_t r;      // columns per slot
  int64_t S;      // slots
};

template <typename T>
inline float ld(const T* p, int64_t i) {
  return cpu::to_f32(p[i]);
}
template <>
inline float ld<float>(const float* p, int64_t i) {
  return p[i];
}

template <typename T>
inline void st(T* p, int64_t i, float v);
template <>
inline void st<float>(float* p, int64_t i, float v) {
  p[i] = v;
}
template <>
inline void st<cpu::bf16_t>(cpu::bf16_t* p, int64_t i, float v) {
  p[i] = cpu::to_bf16(v);
}
template <>
inline void st<cpu::f16_t>(cpu::f16_t* p, int64_t i, float v) {
  p[i] = cpu::to_f16(v);
}

namespace portable {
#include "lora_loops.inc"
}  // namespace portable

#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
#include "lora_loops.inc"
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

template <typename T, typename W>
void lora_run(const LoraGeom& g, const void* x, const void* base, const void* a, const void* wb,
              const int32_t* slots, void* out) {
#if defined(__x86_64__) || defined(_M_X64)
  if (static_cast<int>(cpu::active_isa()) >= static_cast<int>(cpu::Isa::avx2)) {
    return avx2::lora_run<T, W>(g, x, base, a, wb, slots, out);
  }
#endif
  portable::lora_run<T, W>(g, x, base, a, wb, slots, out);
}

template <typename T>
void lora_dispatch_w(ElemType wt, const LoraGeom& g, const void* x, const void* base, const void* a,
                     const void* wb, const int32_t* slots, void* out) {
  switch (wt) {
    case ElemType::f32:
      return lora_run<T, float>(g, x, base, a, wb, slots, out);
    case ElemType::bf16:
      return lora_run<T, cpu::bf16_t>(g, x, base, a, wb, slots, out);
    default:
      return lora_run<T, cpu::f16_t>(g, x, base, a, wb, slots, out);
  }
}

// What the update is added to: a given base output, or the layer's own product computed first
// into the output buffer (dense or affine-quantized weight), so base linear, update and add are
// one op.
enum class BaseKind : uint8_t { given, dense, quantized };

class FastLoraUpdate : public mx::UnaryPrimitive {
 public:
  FastLoraUpdate(mx::Stream s, int slot_count, int rank, int col0, int row0, BaseKind kind, int group_size = 0,
                 int bits = 0)
      : mx::UnaryPrimitive(s), S_(slot_count), r_(rank), col0_(col0), row0_(row0), kind_(kind),
        gs_(group_size), bits_(bits) {}

  // inputs: x (B, .., K), a (rows, K), w_b (N_all, rows), slots (B,) int32, then
  //   given: base (B, .., N);  dense: weight (N, K) [, bias (N,)];  quantized: w, scales, biases
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out_ptr = out.data<void>(), out_type = elem_type(out.dtype()), N = out.shape(-1),
                  S = S_, r = r_, col0 = col0_, row0 = row0_, kind = kind_, gs = gs_, bits = bits_]() {
      const auto &x = inputs[0], &a = inputs[1], &wb = inputs[2], &slots = inputs[3];
      std::vector<uint8_t> bb, xb, ab, wbb, sb, w0, w1, w2;
      LoraGeom g{};
      g.N = N;
      g.K = x.shape(-1);
      g.M = static_cast<int64_t>(x.size()) / g.K;
      g.L = g.M / slots.size();
      g.rows = a.shape(0);
      g.row0 = row0;
      g.col0 = col0;
      g.r = r;
      g.S = S;
      const void* px = contiguous_bytes(x, xb);
      const void* pb = out_ptr;
      if (kind == BaseKind::given) {
        pb = contiguous_bytes(inputs[4], bb);
      } else if (kind == BaseKind::dense) {
        cpu::DenseProblem p{};
        p.K = g.K;
        p.N = g.N;
        p.M = g.M;
        p.x = px;
        p.x_type = elem_type(x.dtype());
        p.w = contiguous_bytes(inputs[4], w0);
        p.w_type = elem_type(inputs[4].dtype());
        p.bias = inputs.size() > 5 ? contiguous_bytes(inputs[5], w1) : nullptr;
        p.bias_type = inputs.size() > 5 ? elem_type(inputs[5].dtype()) : ElemType::f32;
        p.out = out_ptr;
        p.out_type = out_type;
        cpu::dense_matmul(p);
      } else {
        cpu::QuantProblem p{};
        p.N = g.N;
        p.K = g.K;
        p.M = g.M;
        p.x = px;
        p.x_type = elem_type(x.dtype());
        p.w = static_cast<const uint8_t*>(contiguous_bytes(inputs[4], w0));
        p.scales = contiguous_bytes(inputs[5], w1);
        p.biases = contiguous_bytes(inputs[6], w2);
        p.sb_type = elem_type(inputs[5].dtype());
        p.out = out_ptr;
        p.out_type = out_type;
        p.group_size = gs;
        p.bits = bits;
        cpu::quant_matmul(p);
      }
      const void* pa = contiguous_bytes(a, ab);
      const void* pw = contiguous_bytes(wb, wbb);
      const auto* ps = static_cast<const int32_t*>(contiguous_bytes(slots, sb));
      switch (elem_type(x.dtype())) {
        case ElemType::f32:
          return lora_dispatch_w<float>(elem_type(a.dtype()), g, px, pb, pa, pw, ps, out_ptr);
        case ElemType::bf16:
          return lora_dispatch_w<cpu::bf16_t>(elem_type(a.dtype()), g, px, pb, pa, pw, ps, out_ptr);
        default:
          return lora_dispatch_w<cpu::f16_t>(elem_type(a.dtype()), g, px, pb, pa, pw, ps, out_ptr);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override { gpu_unreachable(name()); }

  const char* name() const override { return "FastLoraUpdate"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FastLoraUpdate&>(other);
    return S_ == o.S_ && r_ == o.r_ && col0_ == o.col0_ && row0_ == o.row0_ && kind_ == o.kind_ &&
           gs_ == o.gs_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = kind_ == BaseKind::given ? inputs[4].shape(-1) : inputs[4].shape(0);
    return {shape};
  }

 private:
  int S_, r_, col0_, row0_;
  BaseKind kind_;
  int gs_, bits_;
};

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("[fast_lora_update] " + what);
}

}  // namespace

namespace {

// Shapes common to every form; returns slots as int32.
mx::array checked_slots(const mx::array& x, int N, const mx::array& a, const mx::array& b, const mx::array& slots,
                        int slot_count, int rank, int col0, int row0, mx::StreamOrDevice s) {
  if (x.ndim() < 2 || a.ndim() != 2 || b.ndim() != 2 || slots.ndim() != 1) {
    bad("expects x (B, .., K), a (rows, K), b (N_all, rows), slots (B,).");
  }
  if (slots.shape(0) != x.shape(0)) bad("slots needs one entry per row of x (axis 0).");
  if (!mx::issubdtype(slots.dtype(), mx::integer)) bad("slots must be integers.");
  if (a.shape(1) != x.shape(-1) || b.shape(1) != a.shape(0)) {
    bad("a must be (rows, K = x's last axis) and b (N_all, rows).");
  }
  if (slot_count < 1 || rank < 1 || col0 < 0 || row0 < 0 ||
      col0 + static_cast<int64_t>(slot_count) * rank > a.shape(0) || row0 + N > b.shape(0)) {
    bad("slot_count " + std::to_string(slot_count) + ", rank " + std::to_string(rank) + ", col0 " +
        std::to_string(col0) + " and row0 " + std::to_string(row0) + " do not fit a " +
        std::to_string(a.shape(0)) + "-row a and a " + std::to_string(b.shape(0)) + "-row b.");
  }
  return slots.dtype() == mx::int32 ? slots : mx::astype(slots, mx::int32, s);
}

// The update's own dtypes our kernel takes (x and the output one dtype, a and b one dtype).
bool kernel_case(const mx::Stream& stream, const mx::array& x, mx::Dtype out, const mx::array& a,
                 const mx::array& b) {
  return on_cpu(stream) && kernel_dtype(x.dtype()) && out == x.dtype() && kernel_dtype(a.dtype()) &&
         b.dtype() == a.dtype() && x.size() > 0;
}

}  // namespace

mx::array fast_lora_update(const mx::array& base, const mx::array& x, const mx::array& a,
                           const mx::array& b, const mx::array& slots, int slot_count, int rank,
                           int col0, int row0, mx::StreamOrDevice s) {
  if (base.ndim() != x.ndim()) bad("base and x must have the same rank.");
  for (int d = 0; d + 1 < x.ndim(); ++d) {
    if (base.shape(d) != x.shape(d)) bad("base and x must share their leading axes.");
  }
  const int N = base.shape(-1);
  auto sl = checked_slots(x, N, a, b, slots, slot_count, rank, col0, row0, s);
  const auto stream = mx::to_stream(s);
  const auto out_dtype = mx::promote_types(base.dtype(), x.dtype());
  if (!kernel_case(stream, x, out_dtype, a, b) || base.dtype() != x.dtype()) {
    // the MLX-op formula (lora.h): masked product over the whole width, then add
    auto dt = mx::promote_types(x.dtype(), a.dtype());
    auto c = mx::arange(0, a.shape(0), 1, mx::int32, s);
    auto slot_of = mx::floor_divide(mx::subtract(c, mx::array(col0, mx::int32), s), mx::array(rank, mx::int32), s);
    auto inside = mx::logical_and(mx::greater_equal(c, mx::array(col0, mx::int32), s),
                                  mx::less(c, mx::array(col0 + slot_count * rank, mx::int32), s), s);
    auto want = mx::reshape(sl, {-1, 1}, s);
    auto mask = mx::astype(mx::logical_and(mx::equal(want, mx::expand_dims(slot_of, 0, s), s),
                                           mx::logical_and(mx::expand_dims(inside, 0, s),
                                                           mx::greater(want, mx::array(0, mx::int32), s), s),
                                           s),
                           dt, s);  // (B, rows)
    mx::Shape mshape(x.ndim(), 1);
    mshape[0] = x.shape(0);
    mshape.back() = a.shape(0);
    auto xa = mx::multiply(mx::matmul(mx::astype(x, dt, s), mx::transpose(mx::astype(a, dt, s), s), s),
                           mx::reshape(mask, mshape, s), s);  // (B, .., rows)
    auto bn = mx::slice(mx::astype(b, dt, s), {row0, 0}, {row0 + N, b.shape(1)}, s);  // (N, rows)
    auto delta = mx::matmul(xa, mx::transpose(bn, s), s);                               // (B, .., N)
    return mx::astype(mx::add(mx::astype(base, mx::float32, s), mx::astype(delta, mx::float32, s), s),
                      out_dtype, s);
  }
  return mx::array(base.shape(), out_dtype,
                   std::make_shared<FastLoraUpdate>(stream, slot_count, rank, col0, row0, BaseKind::given),
                   {x, a, b, sl, base});
}

mx::array fast_lora_linear(const mx::array& x, const mx::array& weight, const std::optional<mx::array>& bias,
                           const mx::array& a, const mx::array& b, const mx::array& slots, int slot_count,
                           int rank, int col0, int row0, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  auto dtype = mx::promote_types(x.dtype(), weight.dtype());
  if (bias) dtype = mx::promote_types(dtype, bias->dtype());
  const bool ours = kernel_case(stream, x, dtype, a, b) && weight.ndim() == 2 && x.ndim() >= 2 &&
                    weight.shape(1) == x.shape(-1) && kernel_dtype(weight.dtype()) && weight.size() > 0 &&
                    (!bias || (bias->ndim() == 1 && bias->shape(0) == weight.shape(0) &&
                               kernel_dtype(bias->dtype())));
  if (!ours) {
    return fast_lora_update(fast_linear(x, weight, bias, s), x, a, b, slots, slot_count, rank, col0, row0, s);
  }
  auto sl = checked_slots(x, weight.shape(0), a, b, slots, slot_count, rank, col0, row0, s);
  auto shape = x.shape();
  shape.back() = weight.shape(0);
  std::vector<mx::array> inputs{x, a, b, sl, weight};
  if (bias) inputs.push_back(*bias);
  return mx::array(std::move(shape), dtype,
                   std::make_shared<FastLoraUpdate>(stream, slot_count, rank, col0, row0, BaseKind::dense),
                   std::move(inputs));
}

mx::array fast_lora_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                     const std::optional<mx::array>& biases, int group_size, int bits,
                                     const mx::array& a, const mx::array& b, const mx::array& slots,
                                     int slot_count, int rank, int col0, int row0, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  const auto dtype = mx::promote_types(x.dtype(), scales.dtype());
  bool ours = kernel_case(stream, x, dtype, a, b) && biases.has_value() && (bits == 4 || bits == 8) &&
              (group_size == 32 || group_size == 64 || group_size == 128) && w.dtype() == mx::uint32 &&
              w.ndim() == 2 && scales.ndim() == 2 && kernel_dtype(scales.dtype()) &&
              biases->dtype() == scales.dtype() && biases->shape() == scales.shape() && x.ndim() >= 2 &&
              w.size() > 0;
  if (ours) {
    const int64_t K = static_cast<int64_t>(w.shape(1)) * 32 / bits;
    ours = x.shape(-1) == K && K % group_size == 0 && scales.shape(0) == w.shape(0) &&
           scales.shape(1) == K / group_size;
  }
  if (!ours) {
    auto base = fast_quantized_matmul(x, w, scales, biases, true, group_size, bits, "affine", s);
    return fast_lora_update(base, x, a, b, slots, slot_count, rank, col0, row0, s);
  }
  auto sl = checked_slots(x, w.shape(0), a, b, slots, slot_count, rank, col0, row0, s);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(std::move(shape), dtype,
                   std::make_shared<FastLoraUpdate>(stream, slot_count, rank, col0, row0, BaseKind::quantized,
                                                    group_size, bits),
                   {x, a, b, sl, w, scales, *biases});
}

}  // namespace mlx_infer
