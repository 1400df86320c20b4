// qkv_rope: a fused q|k|v product's output split into contiguous q, k, v with RoPE on q and k, in one CUDA
// kernel (mx::fast::cuda_kernel, NVRTC at run time, as paged_attention_cuda.cpp).
//
// Why: the three views of the fused product are strided (a row holds (H + 2 KVH) D values), so MLX's RoPE
// keeps that stride in its outputs and every consumer that needs a contiguous (R, heads, D) array copies:
// per layer two RoPE launches and three copies (the H200 profile of a llama-1B engine step, 8 rows: 0.25 ms of
// RoPE and 0.11 ms of copies a step, 80 of its 316 launches). This kernel is one launch a layer.
//
// Thread (u, head, row) with u < D / 2: for q and k heads, u < dims / 2 rotates one pair exactly as MLX's
// rope kernel does (mlx/backend/cuda/rope.cu: theta = (scale * position) * inv_freq in float32,
// inv_freq = exp2(-(u / (dims / 2)) * log2(base)) or 1 / freqs[u], cosf / sinf, the same products); the
// pairs are (u, u + dims / 2), or (2u, 2u + 1) when traditional; u >= dims / 2 copies two of the features
// past dims unrotated (partial rotary). v heads copy two features.
#include "qkv_rope_cuda.h"

#include <mlx/fast.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kernel_args.h"
#include "mlx_infer/backend.h"

namespace mlx_infer {

namespace {

// Template constants: T (dtype), kH kKVH kD kDims (rotated features), kTraditional, kFreqs (inv_freq from
// freqs, else from log2(base)), kScaleBits / kLog2BaseBits (float32 bit patterns: kernel_args.h says why not
// an array). freqs: (kDims / 2,) float32 (read only with kFreqs). Outputs q (R, kH, kD), k (R, kKVH, kD),
// v (R, kKVH, kD).
constexpr const char* kQkvRope = R"(
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  const int head = blockIdx.y, r = blockIdx.z;
  constexpr int kHalf = kD / 2, kRot = kDims / 2;
  if (u >= kHalf) return;
  constexpr int kW = (kH + 2 * kKVH) * kD;
  const T* src = qkv + (size_t)r * kW + (size_t)head * kD;
  T* dst;
  if (head < kH) {
    dst = q_out + ((size_t)r * kH + head) * kD;
  } else if (head < kH + kKVH) {
    dst = k_out + ((size_t)r * kKVH + (head - kH)) * kD;
  } else {
    dst = v_out + ((size_t)r * kKVH + (head - kH - kKVH)) * kD;
  }
  if (head >= kH + kKVH || u >= kRot) {  // v, or a feature past the rotated ones: as it is
    const int e = head >= kH + kKVH ? 2 * u : kDims + 2 * (u - kRot);
    dst[e] = src[e];
    dst[e + 1] = src[e + 1];
    return;
  }
  float inv_freq;
  if (kFreqs) {
    inv_freq = 1.0 / freqs[u];
  } else {
    const float d = static_cast<float>(u) / static_cast<float>(kRot);
    inv_freq = exp2f(-d * __int_as_float(kLog2BaseBits));
  }
  const float L = __int_as_float(kScaleBits) * static_cast<float>(positions[r]);
  const float theta = L * inv_freq;
  const float c = cosf(theta);
  const float s = sinf(theta);
  const int i1 = kTraditional ? 2 * u : u;
  const int i2 = kTraditional ? i1 + 1 : i1 + kRot;
  const float x1 = static_cast<float>(src[i1]);
  const float x2 = static_cast<float>(src[i2]);
  const float rx1 = x1 * c - x2 * s;
  const float rx2 = x1 * s + x2 * c;
  dst[i1] = static_cast<T>(rx1);
  dst[i2] = static_cast<T>(rx2);
)";

const ReusedKernel& kernel() {
  static std::once_flag once;
  static ReusedKernel fn;
  std::call_once(once, [] {
    fn = ReusedKernel(mx::fast::cuda_kernel("mlxi_qkv_rope", {"qkv", "positions", "freqs"},
                                            {"q_out", "k_out", "v_out"}, kQkvRope, ""));
  });
  return fn;
}

// The graphs' default where MLX_INFER_QKV_ROPE is unset ("0" off, anything else on).
constexpr bool kQkvRopeDefault = true;

}  // namespace

bool qkv_rope_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MLX_INFER_QKV_ROPE");
    return v == nullptr ? kQkvRopeDefault : std::strcmp(v, "0") != 0;
  }();
  return on;
}

bool qkv_rope_supported(const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope) {
  return cuda_backend() && mx::default_device() == mx::Device::gpu && qkv.ndim() == 2 &&
         qkv.shape(1) == (H + 2 * KVH) * D && cuda_float_dtype(qkv.dtype()) && D % 2 == 0 && rope.dims > 0 && rope.dims % 2 == 0 && rope.dims <= D && rope.mscale == 1.0f && !rope.long_freqs &&
         rope.scale > 0.0f && std::isfinite(rope.scale) &&
         (rope.freqs.has_value() || (rope.base.has_value() && *rope.base >= 1.0f && std::isfinite(*rope.base)));
}

std::array<mx::array, 3> qkv_rope(const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope,
                                  const mx::array& positions, bool kv_write_rows) {
  const int R = qkv.shape(0);
  const bool with_freqs = rope.freqs.has_value();
  auto pos = positions.dtype() == mx::int32 ? positions : mx::astype(positions, mx::int32);
  // Without freqs the positions stand in, never read (no extra op). Explicit shapes: a reshape to the shape an
  // array has adds no graph node (one with -1 would, in every layer of every step).
  auto freqs = with_freqs ? mx::astype(mx::reshape(*rope.freqs, {static_cast<int>(rope.freqs->size())}), mx::float32)
                          : mx::reshape(pos, {R});
  const int half = D / 2;
  const int bx = std::min(half, 128);
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs{
      {"T", qkv.dtype()}, {"kH", H}, {"kKVH", KVH}, {"kD", D}, {"kDims", rope.dims},
      {"kTraditional", rope.traditional}, {"kFreqs", with_freqs},
      {"kScaleBits", float_bits(rope.scale, "the RoPE scale")},
      {"kLog2BaseBits", float_bits(with_freqs ? 0.0f : std::log2(*rope.base), "log2 of the RoPE base")}};
  const std::tuple<int, int, int> grid{((half + bx - 1) / bx) * bx, H + 2 * KVH, R}, block{bx, 1, 1};
  const mx::Shape kv_shape = kv_write_rows ? mx::Shape{R * KVH, 1, 1, 1, D} : mx::Shape{R, KVH, D};
  auto out = kernel()({qkv, mx::reshape(pos, {R}), freqs}, {{R, H, D}, kv_shape, kv_shape},
                      {qkv.dtype(), qkv.dtype(), qkv.dtype()}, grid, block, targs, std::nullopt, false, {});
  return {out[0], out[1], out[2]};
}

}  // namespace mlx_infer
