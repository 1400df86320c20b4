// gated_activation (fused_cuda.h): act(gate) * up read straight from a fused gate|up product's output.
//
// The decode graphs' MLP splits the (R, 2F) product into two views and runs the compiled activation over them
// (Split, then one fused elementwise kernel: two graph nodes). Here one thread a 16-byte chunk of the output
// reads its gate and up chunks from the two halves of the row. Each operation is rounded to the dtype in the
// order the compiled graph's ops round them (decode/graph.cpp swiglu_ops / geglu_ops; MLX's Sigmoid is
// 1 / (1 + exp(|x|)), flipped for x >= 0, mlx/backend/cuda/device/unary_ops.cuh), so the result matches MLX's
// up to its math library's rounding of exp / tanh / pow.
#include "fused_cuda.h"

#include <mlx/fast.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>

#include "mlx_infer/backend.h"

namespace mlx_infer {

namespace {

// mlxi_silu_mul / mlxi_gelu_mul: one element, every operation rounded to T as MLX's graph rounds it.
constexpr const char* kGatedHeader = R"(
template <typename T>
__device__ __forceinline__ T mlxi_silu_mul(T g, T u) {
  const float gf = static_cast<float>(g);
  const T ex = static_cast<T>(expf(fabsf(gf)));
  const T den = static_cast<T>(1.0f + static_cast<float>(ex));
  const T y = static_cast<T>(1.0f / static_cast<float>(den));
  const T sg = gf < 0.0f ? y : static_cast<T>(1.0f - static_cast<float>(y));
  const T a = static_cast<T>(gf * static_cast<float>(sg));
  return static_cast<T>(static_cast<float>(a) * static_cast<float>(u));
}
template <typename T>
__device__ __forceinline__ T mlxi_gelu_mul(T g, T u) {
  const float gf = static_cast<float>(g);
  const T cube = static_cast<T>(powf(gf, 3.0f));
  const T c1 = static_cast<T>(0.044715f), c2 = static_cast<T>(0.7978845608028654f), half = static_cast<T>(0.5f);
  const T inner = static_cast<T>(gf + static_cast<float>(static_cast<T>(static_cast<float>(c1) *
                                                                           static_cast<float>(cube))));
  const T th = static_cast<T>(tanhf(static_cast<float>(static_cast<T>(static_cast<float>(c2) *
                                                                      static_cast<float>(inner)))));
  const T hg = static_cast<T>(static_cast<float>(half) * gf);
  const T one_plus = static_cast<T>(1.0f + static_cast<float>(th));
  const T act = static_cast<T>(static_cast<float>(hg) * static_cast<float>(one_plus));
  return static_cast<T>(static_cast<float>(act) * static_cast<float>(u));
}
)";

// Template constants: T (dtype), kF (output row length), kGelu (gelu_tanh, else silu). gate_up (R, 2 kF);
// output out (R, kF). Grid (chunks rounded up to the block, R): blockIdx.y is the row.
constexpr const char* kGated = R"(
  constexpr int kC = 16 / sizeof(T);
  using V = AlignedVector<T, kC>;
  constexpr int kChunks = kF / kC;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= kChunks) return;
  const V* row = reinterpret_cast<const V*>(gate_up) + (size_t)blockIdx.y * 2 * kChunks;
  const V g = row[c];
  const V u = row[kChunks + c];
  V o;
  #pragma unroll
  for (int e = 0; e < kC; ++e) o[e] = kGelu ? mlxi_gelu_mul<T>(g[e], u[e]) : mlxi_silu_mul<T>(g[e], u[e]);
  reinterpret_cast<V*>(out)[(size_t)blockIdx.y * kChunks + c] = o;
)";

const ReusedKernel& kernel() {
  static std::once_flag once;
  static ReusedKernel fn;
  std::call_once(once, [] {
    fn = ReusedKernel(mx::fast::cuda_kernel("mlxi_gated", {"gate_up"}, {"out"}, kGated, kGatedHeader));
  });
  return fn;
}

constexpr int kMaxRows = 65535;  // the grid's y extent

}  // namespace

bool fused_gated_enabled() {
  return env_int("MLX_INFER_FUSED_GATED", 0, 1, 1, "0: MLX's split and compiled activation") == 1;
}

bool gated_activation_applies(const mx::array& gate_up, const std::string& activation) {
  if (!cuda_backend() || mx::default_device() != mx::Device::gpu ||
      (activation != "silu" && activation != "gelu_tanh")) {
    return false;
  }
  const auto t = gate_up.dtype();
  if (gate_up.ndim() != 2 || !cuda_float_dtype(t) ||
      gate_up.shape(0) < 1 || gate_up.shape(0) > kMaxRows || gate_up.shape(1) % 2 != 0) {
    return false;
  }
  const int F = gate_up.shape(1) / 2;
  return F > 0 && F % (16 / static_cast<int>(mx::size_of(t))) == 0;
}

mx::array gated_activation(const mx::array& gate_up, const std::string& activation) {
  if (activation != "silu" && activation != "gelu_tanh") {
    throw std::invalid_argument("[gated_activation] activation must be 'silu' or 'gelu_tanh', got '" + activation +
                                "'.");
  }
  const int R = gate_up.shape(0), F = gate_up.shape(1) / 2;
  const int chunks = F / (16 / static_cast<int>(mx::size_of(gate_up.dtype())));
  const int block = std::min(256, (chunks + 31) / 32 * 32);
  const int blocks = (chunks + block - 1) / block;
  return kernel()({gate_up}, {{R, F}}, {gate_up.dtype()}, {blocks * block, R, 1}, {block, 1, 1},
                  {{"T", gate_up.dtype()}, {"kF", F}, {"kGelu", activation == "gelu_tanh"}}, std::nullopt, false,
                  {})[0];  // (R, F)
}

}  // namespace mlx_infer
