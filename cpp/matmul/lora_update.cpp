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

// Rows [m0, m1): T the activations' element type, W the adapter's.
template <typename T, typename W>
void lora_rows(const LoraGeom& g, const T* x, const T* base, const W* a, const W* wb, const int32_t* slots,
               T* out, int64_t m0, int64_t m1) {
  std::vector<float> xf(g.K), xa(g.r), acc(g.N);
  for (int64_t m = m0; m < m1; ++m) {
    const int32_t s = slots[m / g.L];
    const T* bm = base + m * g.N;
    T* om = out + m * g.N;
    if (s <= 0 || s >= g.S) {
      std::copy(bm, bm + g.N, om);
      continue;
    }
    const T* xm = x + m * g.K;
    for (int64_t k = 0; k < g.K; ++k) xf[k] = ld(xm, k);
    const int64_t c0 = g.col0 + static_cast<int64_t>(s) * g.r;
    for (int64_t j = 0; j < g.r; ++j) {  // xa = x . a[c0 + j]   (r,)
      const W* aj = a + (c0 + j) * g.K;
      float sum = 0.0f;
      for (int64_t k = 0; k < g.K; ++k) sum += xf[k] * ld(aj, k);
      xa[j] = sum;
    }
    for (int64_t n = 0; n < g.N; ++n) {  // delta = xa @ w_b[row0 + n, c0 : c0 + r]^T   (N,)
      const W* wn = wb + (g.row0 + n) * g.rows + c0;
      float sum = ld(bm, n);
      for (int64_t j = 0; j < g.r; ++j) sum += xa[j] * ld(wn, j);
      acc[n] = sum;
    }
    for (int64_t n = 0; n < g.N; ++n) st(om, n, acc[n]);
  }
}

template <typename T, typename W>
void lora_run(const LoraGeom& g, const void* x, const void* base, const void* a, const void* wb,
              const int32_t* slots, void* out) {
  auto body = [&](int64_t m0, int64_t m1) {
    lora_rows<T, W>(g, static_cast<const T*>(x), static_cast<const T*>(base), static_cast<const W*>(a),
                    static_cast<const W*>(wb), slots, static_cast<T*>(out), m0, m1);
  };
  // Multiply-adds per adapted row; split across the pool only when a task gets real work.
  const int64_t per_row = g.r * (g.K + g.N);
  const int64_t threads = cpu::pool().size();
  const int64_t tasks = std::min<int64_t>(std::min<int64_t>(threads, g.M), g.M * per_row / 32768);
  if (tasks <= 1) {
    body(0, g.M);
    return;
  }
  const int64_t chunk = (g.M + tasks - 1) / tasks;
  cpu::pool().parallel_for(tasks, [&](int64_t t) {
    const int64_t m0 = t * chunk;
    body(m0, std::min(g.M, m0 + chunk));
  });
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

class FastLoraUpdate : public mx::UnaryPrimitive {
 public:
  FastLoraUpdate(mx::Stream s, int slot_count, int rank, int col0, int row0)
      : mx::UnaryPrimitive(s), S_(slot_count), r_(rank), col0_(col0), row0_(row0) {}

  // inputs: base (M.., N), x (M.., K), a (rows, K), w_b (N_all, rows), slots (B,) int32
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out_ptr = out.data<void>(), S = S_, r = r_, col0 = col0_, row0 = row0_]() {
      const auto &base = inputs[0], &x = inputs[1], &a = inputs[2], &wb = inputs[3], &slots = inputs[4];
      std::vector<uint8_t> bb, xb, ab, wbb, sb;
      LoraGeom g{};
      g.N = base.shape(-1);
      g.K = x.shape(-1);
      g.M = static_cast<int64_t>(x.size()) / g.K;
      g.L = g.M / slots.size();
      g.rows = a.shape(0);
      g.row0 = row0;
      g.col0 = col0;
      g.r = r;
      g.S = S;
      const void* pb = contiguous_bytes(base, bb);
      const void* px = contiguous_bytes(x, xb);
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
    return S_ == o.S_ && r_ == o.r_ && col0_ == o.col0_ && row0_ == o.row0_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int S_, r_, col0_, row0_;
};

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("[fast_lora_update] " + what);
}

}  // namespace

mx::array fast_lora_update(const mx::array& base, const mx::array& x, const mx::array& a,
                           const mx::array& b, const mx::array& slots, int slot_count, int rank,
                           int col0, int row0, mx::StreamOrDevice s) {
  if (x.ndim() < 2 || base.ndim() != x.ndim() || a.ndim() != 2 || b.ndim() != 2 || slots.ndim() != 1) {
    bad("expects base (B, .., N), x (B, .., K), a (rows, K), b (N_all, rows), slots (B,).");
  }
  const int N = base.shape(-1), K = x.shape(-1);
  for (int d = 0; d + 1 < x.ndim(); ++d) {
    if (base.shape(d) != x.shape(d)) bad("base and x must share their leading axes.");
  }
  if (slots.shape(0) != x.shape(0)) bad("slots needs one entry per row of x (axis 0).");
  if (!mx::issubdtype(slots.dtype(), mx::integer)) bad("slots must be integers.");
  if (a.shape(1) != K || b.shape(1) != a.shape(0)) {
    bad("a must be (rows, K = x's last axis) and b (N_all, rows).");
  }
  if (slot_count < 1 || rank < 1 || col0 < 0 || row0 < 0 ||
      col0 + static_cast<int64_t>(slot_count) * rank > a.shape(0) || row0 + N > b.shape(0)) {
    bad("slot_count " + std::to_string(slot_count) + ", rank " + std::to_string(rank) + ", col0 " +
        std::to_string(col0) + " and row0 " + std::to_string(row0) + " do not fit a " +
        std::to_string(a.shape(0)) + "-row a and a " + std::to_string(b.shape(0)) + "-row b.");
  }
  const auto stream = mx::to_stream(s);
  const auto out_dtype = mx::promote_types(base.dtype(), x.dtype());
  auto sl = slots.dtype() == mx::int32 ? slots : mx::astype(slots, mx::int32, s);
  const bool ours = on_cpu(stream) && kernel_dtype(x.dtype()) && base.dtype() == x.dtype() &&
                    kernel_dtype(a.dtype()) && b.dtype() == a.dtype() && x.size() > 0;
  if (!ours) {  // the MLX-op formula (lora.h): masked product over the whole width, then add
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
                           mx::reshape(mask, mshape, s), s);
    auto bn = mx::slice(mx::astype(b, dt, s), {row0, 0}, {row0 + N, b.shape(1)}, s);
    auto delta = mx::matmul(xa, mx::transpose(bn, s), s);
    return mx::astype(mx::add(mx::astype(base, mx::float32, s), mx::astype(delta, mx::float32, s), s),
                      out_dtype, s);
  }
  return mx::array(base.shape(), out_dtype,
                   std::make_shared<FastLoraUpdate>(stream, slot_count, rank, col0, row0),
                   {base, x, a, b, sl});
}

}  // namespace mlx_infer
