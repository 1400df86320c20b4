// The CPU kernels behind the matmul primitives: problem descriptions and the
// run-time dispatch by instruction set. Internal to cpp/cpu_kernels/ (and the CPU attention in cpp/attention/).
#pragma once

#include <cstdint>
#include <string>

namespace mlx_infer::cpu {

enum class ElemType : uint8_t { f32, bf16, f16 };

/// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); all row-contiguous.
struct DenseProblem {
  const void* x;  // (M, K)
  ElemType x_type;
  const void* w;  // (N, K)
  ElemType w_type;
  const void* bias;  // (N,) or nullptr
  ElemType bias_type;
  void* out;  // (M, N)
  ElemType out_type;
  int64_t M, N, K;
};

/// out[m, n] = sum_k x[m, k] * (scale[n, g] * q[n, k] + bias[n, g]),  g = k / group_size,
/// q unpacked from MLX's affine layout: uint32 words, 32/bits values per word,
/// least significant bits first (byte order == k order on little-endian hosts).
struct QuantProblem {
  const void* x;  // (M, K)
  ElemType x_type;
  const uint8_t* w;  // (N, K * bits / 8) bytes
  const void* scales;  // (N, K / group_size)
  const void* biases;  // (N, K / group_size)
  ElemType sb_type;
  void* out;  // (M, N)
  ElemType out_type;
  int64_t M, N, K;
  int group_size;
  int bits;  // 4 or 8
};

/// Softmax attention, one output row per (b, h, l):
///   out[b,h,l,:] = softmax_s(scale * q[b,h,l,:] . k[b,h/rep,s,:] + mask) @ v[b,h/rep,:,:]
/// q/k/v share a dtype; their last axis is contiguous, other axes strided (elements).
struct AttnProblem {
  const void* q;  // (B, H, L, D)
  const void* k;  // (B, KVH, S, D)
  const void* v;  // (B, KVH, S, Dv)
  ElemType type;
  int64_t B, H, KVH, L, S, D, Dv;
  int64_t q_str[3], k_str[3], v_str[3];  // strides of (b, h, l|s)
  float scale;
  /// Key s is visible to query l only when s <= l + S - L (MLX's "causal").
  bool causal;
  /// Optional (B, H, L, S) mask with strides (0 = broadcast): bool (true =
  /// attend) or float (added to the scaled scores).
  const void* mask;
  int mask_kind;  // 0 none, 1 bool, 2 additive
  ElemType mask_type;
  int64_t mask_str[4];
  void* out;  // (B, H, L, Dv), contiguous
  ElemType out_type;
};

/// out[i] = act(gate[i]) * up[i] (contiguous, n elements, one dtype):
///   gelu_approx(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3))   (== 0.5 g (1 + tanh(...)))
///   silu(g)        = g * sigmoid(g)
enum class Activation : uint8_t { gelu_approx, silu };
struct GatedActProblem {
  const void* gate;
  const void* up;
  ElemType type;
  int64_t n;
  void* out;
  Activation act;
};

/// Kernel variants, each a superset of the one before. avx512vnni: avx512,
/// plus int8 dot products for quantized GEMV (x quantized to int8 per 32 values).
enum class Isa : uint8_t { generic = 0, avx2 = 1, avx512 = 2, avx512vnni = 3 };

/// The widest instruction set this CPU supports.
Isa detected_isa();
/// What kernels use unless told otherwise: detected_isa(), but never
/// avx512vnni (its int8 activations are opt-in).
Isa default_isa();
/// The instruction set kernels use now (the default, unless forced).
Isa active_isa();
void force_isa(Isa isa);
const char* isa_name(Isa isa);

void dense_matmul(const DenseProblem& p);
void quant_matmul(const QuantProblem& p);
void attention(const AttnProblem& p);
void gated_activation(const GatedActProblem& p);

// One entry point pair per instruction set (kernels_<isa>.cpp).
namespace generic {
void dense_matmul(const DenseProblem& p);
void quant_matmul(const QuantProblem& p);
void attention(const AttnProblem& p);
void gated_activation(const GatedActProblem& p);
}  // namespace generic
#if defined(__x86_64__) || defined(_M_X64)
namespace avx2 {
void dense_matmul(const DenseProblem& p);
void quant_matmul(const QuantProblem& p);
void attention(const AttnProblem& p);
void gated_activation(const GatedActProblem& p);
}  // namespace avx2
namespace avx512 {
void dense_matmul(const DenseProblem& p);
void quant_matmul(const QuantProblem& p);
void attention(const AttnProblem& p);
void gated_activation(const GatedActProblem& p);
}  // namespace avx512
namespace avx512vnni {
/// Quantized GEMV (M <= 4, K % 64 == 0) with int8 dot products; false: not applicable.
bool quant_gemv(const QuantProblem& p);
}  // namespace avx512vnni
#endif

}  // namespace mlx_infer::cpu
