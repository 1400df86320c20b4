// act(gate) * up for gated MLPs (GeGLU, SwiGLU). MLX's CPU backend evaluates
// these activations element by element through scalar libm calls (tanhf, powf,
// expm1f), which took ~45% of a 512-token CPU prefill of Gemma 3 270M.
#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include <cmath>
#include <memory>
#include <stdexcept>
#include <vector>

#include "array_util.h"
#include "kernels.h"
#include "mlx_infer/matmul.h"

namespace mlx_infer {

namespace {

using cpu::Activation;
using namespace detail;

class FastGatedActivation : public mx::UnaryPrimitive {
 public:
  FastGatedActivation(mx::Stream s, Activation act) : mx::UnaryPrimitive(s), act_(act) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) {
      enc.set_input_array(a);
    }
    enc.set_output_array(out);
    enc.dispatch([inputs, out_ptr = out.data<void>(), act = act_]() {
      std::vector<uint8_t> gb, ub;
      cpu::GatedActProblem p{};
      p.gate = contiguous_bytes(inputs[0], gb);
      p.up = contiguous_bytes(inputs[1], ub);
      p.type = elem_type(inputs[0].dtype());
      p.n = static_cast<int64_t>(inputs[0].size());
      p.out = out_ptr;
      p.act = act;
      cpu::gated_activation(p);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override { gpu_unreachable(name()); }

  const char* name() const override { return "FastGatedActivation"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return act_ == static_cast<const FastGatedActivation&>(other).act_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  Activation act_;
};

// The stock formulas (mlx.nn.gelu_approx, mlx.nn.silu), for GPU streams and other dtypes.
mx::array stock(const mx::array& gate, const mx::array& up, Activation act, mx::StreamOrDevice s) {
  if (act == Activation::silu) {
    return mx::multiply(mx::multiply(gate, mx::sigmoid(gate, s), s), up, s);
  }
  const float c = std::sqrt(2.0f / static_cast<float>(M_PI));
  auto cube = mx::multiply(mx::multiply(gate, gate, s), gate, s);
  auto inner = mx::multiply(mx::array(c, gate.dtype()),
                            mx::add(gate, mx::multiply(mx::array(0.044715f, gate.dtype()), cube, s), s), s);
  auto g = mx::multiply(mx::multiply(mx::array(0.5f, gate.dtype()), gate, s),
                        mx::add(mx::array(1.0f, gate.dtype()), mx::tanh(inner, s), s), s);
  return mx::multiply(g, up, s);
}

}  // namespace

mx::array fast_gated_activation(const mx::array& gate, const mx::array& up,
                                const std::string& activation, mx::StreamOrDevice s) {
  Activation act;
  if (activation == "gelu_approx") {
    act = Activation::gelu_approx;
  } else if (activation == "silu") {
    act = Activation::silu;
  } else {
    throw std::invalid_argument("[fast_gated_activation] unknown activation '" + activation +
                                "'; choose 'gelu_approx' or 'silu'.");
  }
  const auto stream = mx::to_stream(s);
  const bool ours = on_cpu(stream) && kernel_dtype(gate.dtype()) && up.dtype() == gate.dtype() &&
                    up.shape() == gate.shape();
  if (!ours) {
    return stock(gate, up, act, s);
  }
  return mx::array(gate.shape(), gate.dtype(), std::make_shared<FastGatedActivation>(stream, act),
                   {gate, up});
}

}  // namespace mlx_infer
