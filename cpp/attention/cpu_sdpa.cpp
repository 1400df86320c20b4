// Scaled dot-product attention on the CPU kernels (MLX's CPU backend has no
// fused SDPA: it falls back to matmul + softmax + matmul through the reference
// BLAS or its scalar bfloat16 GEMM, which dominates CPU prefill).
#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/fast.h>
#include <mlx/primitives.h>

#include <memory>
#include <utility>
#include <vector>

#include "../cpu_kernels/array_util.h"
#include "../cpu_kernels/kernels.h"
#include "mlx_infer/cpu_attention.h"

namespace mlx_infer {

namespace {

using cpu::ElemType;
using namespace detail;

// Pointer to `a` with a contiguous last axis, and its (b, h, row) strides.
const void* strided_view(const mx::array& a, std::vector<uint8_t>& buf, int64_t str[3]) {
  if (a.strides()[3] == 1) {
    for (int i = 0; i < 3; ++i) {
      str[i] = a.strides()[i];
    }
    return a.data<uint8_t>();
  }
  const void* p = contiguous_bytes(a, buf);
  str[2] = a.shape(3);
  str[1] = str[2] * a.shape(2);
  str[0] = str[1] * a.shape(1);
  return p;
}

class FastSDPA : public mx::UnaryPrimitive {
 public:
  FastSDPA(mx::Stream s, float scale, bool causal, int mask_kind)
      : mx::UnaryPrimitive(s), scale_(scale), causal_(causal), mask_kind_(mask_kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) {
      enc.set_input_array(a);
    }
    enc.set_output_array(out);
    enc.dispatch([inputs, out_ptr = out.data<void>(), out_type = elem_type(out.dtype()),
                  scale = scale_, causal = causal_, mask_kind = mask_kind_]() {
      const mx::array& q = inputs[0];
      const mx::array& k = inputs[1];
      const mx::array& v = inputs[2];
      std::vector<uint8_t> qb, kb, vb;
      cpu::AttnProblem p{};
      p.q = strided_view(q, qb, p.q_str);
      p.k = strided_view(k, kb, p.k_str);
      p.v = strided_view(v, vb, p.v_str);
      p.type = elem_type(q.dtype());
      p.B = q.shape(0);
      p.H = q.shape(1);
      p.L = q.shape(2);
      p.D = q.shape(3);
      p.KVH = k.shape(1);
      p.S = k.shape(2);
      p.Dv = v.shape(3);
      p.scale = scale;
      p.causal = causal;
      p.mask_kind = mask_kind;
      if (mask_kind != 0) {
        const mx::array& m = inputs[3];
        p.mask = m.data<void>();
        p.mask_type = m.dtype() == mx::bool_ ? ElemType::f32 : elem_type(m.dtype());
        const int64_t target[4] = {p.B, p.H, p.L, p.S};
        const int off = 4 - static_cast<int>(m.ndim());
        for (int i = 0; i < 4; ++i) {
          const int j = i - off;
          p.mask_str[i] = (j < 0 || (m.shape(j) == 1 && target[i] != 1)) ? 0 : m.strides()[j];
        }
      }
      p.out = out_ptr;
      p.out_type = out_type;
      cpu::attention(p);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override { gpu_unreachable(name()); }

  const char* name() const override { return "FastSDPA"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FastSDPA&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && mask_kind_ == o.mask_kind_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[2].shape(3);
    return {shape};
  }

 private:
  float scale_;
  bool causal_;
  int mask_kind_;
};

}  // namespace

mx::array fast_sdpa(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::string& mask_mode, const std::optional<mx::array>& mask,
                    mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  bool ours = on_cpu(stream) && q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 &&
              kernel_dtype(q.dtype()) && k.dtype() == q.dtype() && v.dtype() == q.dtype() &&
              q.shape(0) == k.shape(0) && k.shape(0) == v.shape(0) && k.shape(1) == v.shape(1) &&
              k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0 && q.shape(3) == k.shape(3) &&
              k.shape(2) == v.shape(2) && q.size() > 0 && k.size() > 0 && v.size() > 0 &&
              (mask_mode.empty() || mask_mode == "causal" || (mask_mode == "array" && mask));
  int mask_kind = 0;
  if (ours && mask_mode == "array") {
    const auto& m = *mask;
    mask_kind = m.dtype() == mx::bool_ ? 1 : (kernel_dtype(m.dtype()) ? 2 : -1);
    const int target[4] = {q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    ours = mask_kind > 0 && m.ndim() <= 4;
    for (int j = 0; ours && j < static_cast<int>(m.ndim()); ++j) {
      const int t = target[4 - m.ndim() + j];
      ours = m.shape(j) == t || m.shape(j) == 1;
    }
  }
  if (!ours) {
    return mx::fast::scaled_dot_product_attention(q, k, v, scale, mask_mode, mask, {}, false, s);
  }
  std::vector<mx::array> inputs{q, k, v};
  if (mask_kind > 0) {
    inputs.push_back(*mask);
  }
  auto shape = q.shape();
  shape.back() = v.shape(3);
  return mx::array(std::move(shape), q.dtype(),
                   std::make_shared<FastSDPA>(stream, scale, mask_mode == "causal", mask_kind),
                   std::move(inputs));
}

}  // namespace mlx_infer
