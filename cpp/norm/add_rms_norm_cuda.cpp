// add_rms_norm: the residual add of a decode layer and the RMS norm that follows it, in one CUDA kernel
// (mx::fast::cuda_kernel, NVRTC at run time, as qkv_rope_cuda.cpp).
//
// Why: a decode step is host-bound at few rows, and MLX's cost to submit a step grows with its kernel count
// (an H100 llama-1B step, session 20: ~215 kernels, ~7 us each to submit). Every layer has two residual adds,
// each followed by a norm (the MLP's, the next layer's attention's): one launch instead of two for each pair,
// and the sum is read once from registers instead of again from memory.
//
// One block of kThreads threads per row of E values. Pass 1: s = T(float(h) + float(r)) (MLX's add of two T in
// float, rounded once), stored, its float32 squares summed per thread, then per warp (xor shuffles) and over the
// warps in shared memory. Pass 2 rereads the row's s (each thread its own elements: no barrier needed) and
// writes w * T(float(s) * rsqrt(sum / E + eps)) with the product formed in float and rounded once, which is
// what MLX's rms_norm computes for float32, float16 and bfloat16 (two T's product is exact in float). Only the
// order of the sum of squares differs from MLX's kernel (a float32 rounding).
#include "add_rms_norm_cuda.h"

#include <mlx/fast.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "../attention/kernel_args.h"
#include "mlx_infer/backend.h"

namespace mlx_infer {

namespace {

// Template constants: T (dtype), kE (row length), kThreads (a multiple of 32, <= 1024), kEpsBits (eps's float32
// bit pattern: kernel_args.h says why not an array). Inputs h, r (rows, kE), w (kE,); outputs s_out, n_out.
constexpr const char* kAddRmsNorm = R"(
  const int row = blockIdx.x;
  const int t = threadIdx.x;
  const T* hr = h + (size_t)row * kE;
  const T* rr = r + (size_t)row * kE;
  T* sr = s_out + (size_t)row * kE;
  T* nr = n_out + (size_t)row * kE;
  float acc = 0.0f;
  for (int i = t; i < kE; i += kThreads) {
    const T s = static_cast<T>(static_cast<float>(hr[i]) + static_cast<float>(rr[i]));
    sr[i] = s;
    const float f = static_cast<float>(s);
    acc += f * f;
  }
  for (int o = 16; o > 0; o /= 2) {
    acc += __shfl_xor_sync(0xffffffff, acc, o);
  }
  __shared__ float warp_sums[32];
  if (t % 32 == 0) {
    warp_sums[t / 32] = acc;
  }
  __syncthreads();
  float total = 0.0f;
  for (int k = 0; k < kThreads / 32; ++k) {
    total += warp_sums[k];
  }
  const float normalizer = rsqrtf(total / static_cast<float>(kE) + __int_as_float(kEpsBits));
  for (int i = t; i < kE; i += kThreads) {
    const T y = static_cast<T>(static_cast<float>(sr[i]) * normalizer);
    nr[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(y));
  }
)";

const mx::fast::CustomKernelFunction& kernel() {
  static std::once_flag once;
  static mx::fast::CustomKernelFunction fn;
  std::call_once(once, [] {
    fn = mx::fast::cuda_kernel("mlxi_add_rms_norm", {"h", "r", "w"}, {"s_out", "n_out"}, kAddRmsNorm, "");
  });
  return fn;
}

// The graphs' default where MLX_INFER_ADD_NORM is unset ("1" on, anything else off).
constexpr bool kAddRmsNormDefault = false;

bool float_dtype(mx::Dtype t) {
  return t == mx::float32 || t == mx::bfloat16 || t == mx::float16;
}

}  // namespace

bool add_rms_norm_enabled() {  // read at each graph build (a trace, or an op-by-op step): an A/B in one process
  const char* v = std::getenv("MLX_INFER_ADD_NORM");
  return v == nullptr ? kAddRmsNormDefault : std::strcmp(v, "1") == 0;
}

bool add_rms_norm_supported(const mx::array& h, const mx::array& r, const mx::array& w, float eps) {
  if (!cuda_backend() || mx::default_device() != mx::Device::gpu || h.ndim() != 2 || r.shape() != h.shape() ||
      w.ndim() != 1 || !float_dtype(h.dtype()) || r.dtype() != h.dtype() || w.dtype() != h.dtype()) {
    return false;
  }
  const int E = h.shape(1);
  return w.shape(0) == E && E % 4 == 0 && E <= 65536 && h.shape(0) > 0 && !std::signbit(eps) && std::isfinite(eps);
}

std::pair<mx::array, mx::array> add_rms_norm(const mx::array& h, const mx::array& r, const mx::array& w, float eps) {
  const int R = h.shape(0), E = h.shape(1);
  int threads = 32;  // one thread per 4 values (at most 1024): a row's loads in a few iterations
  while (threads < 1024 && threads * 4 < E) threads *= 2;
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs{
      {"T", h.dtype()}, {"kE", E}, {"kThreads", threads}, {"kEpsBits", float_bits(eps, "the RMS norm's eps")}};
  const std::tuple<int, int, int> grid{R * threads, 1, 1}, block{threads, 1, 1};
  auto out = kernel()({h, r, w}, {{R, E}, {R, E}}, {h.dtype(), h.dtype()}, grid, block, targs, std::nullopt,
                      false, {});
  return {out[0], out[1]};
}

}  // namespace mlx_infer
