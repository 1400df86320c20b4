// The MLX primitives over the CPU kernels, and the ops that build them.
//
// eval_cpu runs on the thread that evaluates the graph; like MLX's own CPU
// primitives it only allocates the output and queues the work on the stream's
// command encoder, so inputs are read when earlier work on the stream is done.
#include "mlx_infer/matmul.h"

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "array_util.h"
#include "kernels.h"
#include "threadpool.h"

namespace mlx_infer {

namespace {

using cpu::ElemType;
using namespace detail;

class FastLinear : public mx::UnaryPrimitive {
 public:
  explicit FastLinear(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) {
      enc.set_input_array(a);
    }
    enc.set_output_array(out);
    enc.dispatch([inputs, out_ptr = out.data<void>(), out_type = elem_type(out.dtype())]() {
      const mx::array& x = inputs[0];
      const mx::array& w = inputs[1];
      std::vector<uint8_t> xb, wb, bb;
      cpu::DenseProblem p{};
      p.K = w.shape(1);
      p.N = w.shape(0);
      p.M = static_cast<int64_t>(x.size()) / p.K;
      p.x = contiguous_bytes(x, xb);
      p.x_type = elem_type(x.dtype());
      p.w = contiguous_bytes(w, wb);
      p.w_type = elem_type(w.dtype());
      p.bias = inputs.size() > 2 ? contiguous_bytes(inputs[2], bb) : nullptr;
      p.bias_type = inputs.size() > 2 ? elem_type(inputs[2].dtype()) : ElemType::f32;
      p.out = out_ptr;
      p.out_type = out_type;
      cpu::dense_matmul(p);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override { gpu_unreachable(name()); }

  const char* name() const override { return "FastLinear"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
};

class FastQuantizedMatmul : public mx::UnaryPrimitive {
 public:
  FastQuantizedMatmul(mx::Stream s, int group_size, int bits)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) {
      enc.set_input_array(a);
    }
    enc.set_output_array(out);
    enc.dispatch([inputs, out_ptr = out.data<void>(), out_type = elem_type(out.dtype()),
                  gs = group_size_, bits = bits_]() {
      const mx::array& x = inputs[0];
      const mx::array& w = inputs[1];
      std::vector<uint8_t> xb, wb, sb, bb;
      cpu::QuantProblem p{};
      p.N = w.shape(0);
      p.K = static_cast<int64_t>(w.shape(1)) * 32 / bits;
      p.M = static_cast<int64_t>(x.size()) / p.K;
      p.x = contiguous_bytes(x, xb);
      p.x_type = elem_type(x.dtype());
      p.w = static_cast<const uint8_t*>(contiguous_bytes(w, wb));
      p.scales = contiguous_bytes(inputs[2], sb);
      p.biases = contiguous_bytes(inputs[3], bb);
      p.sb_type = elem_type(inputs[2].dtype());
      p.out = out_ptr;
      p.out_type = out_type;
      p.group_size = gs;
      p.bits = bits;
      cpu::quant_matmul(p);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override { gpu_unreachable(name()); }

  const char* name() const override { return "FastQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FastQuantizedMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_size_;
  int bits_;
};

}  // namespace

mx::array fast_linear(const mx::array& x, const mx::array& weight,
                      const std::optional<mx::array>& bias, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  const bool ours = on_cpu(stream) && x.ndim() >= 1 && weight.ndim() == 2 &&
                    x.shape(-1) == weight.shape(1) && kernel_dtype(x.dtype()) &&
                    kernel_dtype(weight.dtype()) && x.size() > 0 && weight.size() > 0 &&
                    (!bias || (bias->ndim() == 1 && bias->shape(0) == weight.shape(0) &&
                               kernel_dtype(bias->dtype())));
  if (!ours) {
    if (bias) {
      return mx::addmm(*bias, x, mx::transpose(weight, s), 1.0f, 1.0f, s);
    }
    return mx::matmul(x, mx::transpose(weight, s), s);
  }
  auto dtype = mx::promote_types(x.dtype(), weight.dtype());
  std::vector<mx::array> inputs{x, weight};
  if (bias) {
    dtype = mx::promote_types(dtype, bias->dtype());
    inputs.push_back(*bias);
  }
  auto shape = x.shape();
  shape.back() = weight.shape(0);
  return mx::array(std::move(shape), dtype, std::make_shared<FastLinear>(stream),
                   std::move(inputs));
}

mx::array fast_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                const std::optional<mx::array>& biases, bool transpose,
                                int group_size, int bits, const std::string& mode,
                                mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  bool ours = on_cpu(stream) && transpose && mode == "affine" && biases.has_value() &&
              (bits == 4 || bits == 8) &&
              (group_size == 32 || group_size == 64 || group_size == 128) &&
              w.dtype() == mx::uint32 && w.ndim() == 2 && scales.ndim() == 2 &&
              kernel_dtype(x.dtype()) && kernel_dtype(scales.dtype()) &&
              biases->dtype() == scales.dtype() && biases->shape() == scales.shape() &&
              x.ndim() >= 1 && x.size() > 0 && w.size() > 0;
  if (ours) {
    const int64_t K = static_cast<int64_t>(w.shape(1)) * 32 / bits;
    ours = x.shape(-1) == K && K % group_size == 0 && scales.shape(0) == w.shape(0) &&
           scales.shape(1) == K / group_size;
  }
  if (!ours) {  // on CUDA, a few rows of a transposed product take our dequantizing GEMV (quantized_linear)
    return transpose ? quantized_linear(x, w, scales, biases, group_size, bits, mode, s)
                     : mx::quantized_matmul(x, w, scales, biases, transpose, group_size, bits, mode, s);
  }
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(std::move(shape), mx::promote_types(x.dtype(), scales.dtype()),
                   std::make_shared<FastQuantizedMatmul>(stream, group_size, bits),
                   {x, w, scales, *biases});
}

std::string cpu_kernel_isa() { return cpu::isa_name(cpu::active_isa()); }

int cpu_threads() { return cpu::pool().size(); }

void set_cpu_kernel_isa(const std::string& isa) {
  if (isa.empty()) {
    cpu::force_isa(cpu::default_isa());
    return;
  }
  cpu::Isa want;
  if (isa == "avx512vnni") {
    want = cpu::Isa::avx512vnni;
  } else if (isa == "avx512") {
    want = cpu::Isa::avx512;
  } else if (isa == "avx2") {
    want = cpu::Isa::avx2;
  } else if (isa == "generic") {
    want = cpu::Isa::generic;
  } else {
    throw std::invalid_argument("[set_cpu_kernel_isa] unknown instruction set '" + isa +
                                "'; choose 'avx512vnni', 'avx512', 'avx2', 'generic' or '' (automatic).");
  }
  if (static_cast<int>(want) > static_cast<int>(cpu::detected_isa())) {
    throw std::invalid_argument("[set_cpu_kernel_isa] this CPU lacks '" + isa +
                                "'; the widest it supports is '" +
                                cpu::isa_name(cpu::detected_isa()) + "'.");
  }
  cpu::force_isa(want);
}

}  // namespace mlx_infer
