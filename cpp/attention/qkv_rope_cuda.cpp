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
// freqs, else from log2(base)), kScaleBits / kLog2BaseBits / kEpsBits (float32 bit patterns: kernel_args.h
// says why not an array), kQkNorm (q and k heads RMS-normed first, by q_w / k_w (kD,); the block is then one
// head, kD / 2 threads rounded up to a warp), kBlock (the block's threads). freqs: (kDims / 2,) float32 (read
// only with kFreqs). Outputs q (R, kH, kD), and MLXI_KV_DST (kKvOut or kKvWrite) says where a K or V head's
// features go.
constexpr const char* kQkvRope = R"(
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  const int head = blockIdx.y, r = blockIdx.z;
  constexpr int kHalf = kD / 2, kRot = kDims / 2;
  if (!kQkNorm && u >= kHalf) return;  // with kQkNorm the block is one head: every thread joins its reduction
  constexpr int kW = (kH + 2 * kKVH) * kD;
  const T* src = qkv + (size_t)r * kW + (size_t)head * kD;
  const bool is_v = head >= kH + kKVH;
  const bool rotates = !is_v && u < kRot;
  // this thread's two features: a rotated pair, or two past the rotated ones (partial rotary), or two of v
  const int i1 = rotates ? (kTraditional ? 2 * u : u) : (is_v ? 2 * u : kDims + 2 * (u - kRot));
  const int i2 = rotates ? (kTraditional ? i1 + 1 : i1 + kRot) : i1 + 1;
  float x1 = u < kHalf ? static_cast<float>(src[i1]) : 0.0f;
  float x2 = u < kHalf ? static_cast<float>(src[i2]) : 0.0f;
  if (kQkNorm && !is_v) {  // the head's RMSNorm (q_w or k_w) as mx::fast::rms_norm, before the rotation
    __shared__ float warp_sums[(kBlock + 31) / 32];  // kBlock is a multiple of 32 here; not without norms
    const float inv = rsqrtf(block_sum<kBlock>(x1 * x1 + x2 * x2, warp_sums) / static_cast<float>(kD) +
                             __int_as_float(kEpsBits));
    if (u >= kHalf) return;
    const T* w = head < kH ? q_w : k_w;
    x1 = static_cast<float>(static_cast<T>(static_cast<float>(w[i1]) * static_cast<float>(static_cast<T>(x1 * inv))));
    x2 = static_cast<float>(static_cast<T>(static_cast<float>(w[i2]) * static_cast<float>(static_cast<T>(x2 * inv))));
  }
  if (u >= kHalf) return;
  T* dst;
  if (head < kH) {
    dst = q_out + ((size_t)r * kH + head) * kD;
  } else {
    const bool is_k = !is_v;
    const int h = head - kH - (is_k ? 0 : kKVH);
    MLXI_KV_DST
  }
  if (!rotates) {  // v, or a feature past the rotated ones: as it is (normed where k is)
    dst[i1] = static_cast<T>(x1);
    dst[i2] = static_cast<T>(x2);
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
  const float rx1 = x1 * c - x2 * s;
  const float rx2 = x1 * s + x2 * c;
  dst[i1] = static_cast<T>(rx1);
  dst[i2] = static_cast<T>(rx2);
)";

// Outputs k (R, kKVH, kD) and v (R, kKVH, kD).
constexpr const char* kKvOut = "dst = (is_k ? k_out : v_out) + ((size_t)r * kKVH + h) * kD;";

// Into the paged storage k_pool / v_pool (pages, kKVH, kP, kD) at row r's slot (page slot / kP, offset slot % kP),
// in place: MLX's kernels take their inputs const, and these are the step's storage, written here exactly
// where the K/V Scatter wrote (qkv_rope_write says why that is safe).
constexpr const char* kKvWrite = R"(const int slot = slots[r];
    T* pool = const_cast<T*>(is_k ? k_pool : v_pool);
    dst = pool + (((size_t)(slot / kP) * kKVH + h) * kP + slot % kP) * kD;)";

std::string with_kv_dst(const char* dst) {
  std::string s = kQkvRope;
  s.replace(s.find("MLXI_KV_DST"), std::strlen("MLXI_KV_DST"), dst);
  return s;
}

// [0]: q, k, v out; [1]: q out, k and v written into the storage.
const ReusedKernel& kernel(bool write) {
  static std::once_flag once;
  static ReusedKernel fns[2];
  std::call_once(once, [] {
    fns[0] = ReusedKernel(mx::fast::cuda_kernel("mlxi_qkv_rope", {"qkv", "positions", "freqs", "q_w", "k_w"},
                                                {"q_out", "k_out", "v_out"}, with_kv_dst(kKvOut), kBlockSumHeader));
    fns[1] = ReusedKernel(mx::fast::cuda_kernel("mlxi_qkv_rope_write",
                                                {"qkv", "positions", "freqs", "q_w", "k_w", "slots", "k_pool",
                                                 "v_pool"},
                                                {"q_out"}, with_kv_dst(kKvWrite), kBlockSumHeader));
  });
  return fns[write ? 1 : 0];
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

bool qkv_rope_write_enabled() {  // read at each call: a graph's trace (an A/B in one process)
  const char* v = std::getenv("MLX_INFER_QKV_ROPE_WRITE");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

bool qkv_rope_norm_enabled() {  // read at each call: a graph's trace (an A/B in one process)
  return env_int("MLX_INFER_QKV_ROPE_NORM", 0, 1, 1, "0: the q/k norms as MLX's RMSNorm, RoPE and Scatters") == 1;
}

bool qkv_rope_supported(const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope, const QkNorm* norm) {
  if (norm != nullptr) {
    auto fits = [&](const mx::array& w) { return w.ndim() == 1 && w.shape(0) == D && w.dtype() == qkv.dtype(); };
    if (!fits(norm->q_w) || !fits(norm->k_w) || D / 2 > 1024 || !(norm->eps >= 0.0f) || !std::isfinite(norm->eps)) {
      return false;
    }
  }
  return cuda_backend() && mx::default_device() == mx::Device::gpu && qkv.ndim() == 2 &&
         qkv.shape(1) == (H + 2 * KVH) * D && cuda_float_dtype(qkv.dtype()) && D % 2 == 0 && rope.dims > 0 && rope.dims % 2 == 0 && rope.dims <= D && rope.mscale == 1.0f && !rope.long_freqs &&
         rope.scale > 0.0f && std::isfinite(rope.scale) &&
         (rope.freqs.has_value() || (rope.base.has_value() && *rope.base >= 1.0f && std::isfinite(*rope.base)));
}

namespace {

// The launch both entries share: grid (D / 2 rounded to the block, heads, rows), the template constants, the
// inputs after qkv (positions, freqs, q_w, k_w).
struct RopeLaunch {
  std::vector<mx::array> inputs;
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs;
  std::tuple<int, int, int> grid, block;
};

RopeLaunch rope_launch(const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope,
                       const mx::array& positions, const QkNorm* norm) {
  const int R = qkv.shape(0);
  const bool with_freqs = rope.freqs.has_value();
  auto pos = mx::reshape(positions.dtype() == mx::int32 ? positions : mx::astype(positions, mx::int32), {R});
  // Without freqs the positions stand in, never read (no extra op). Explicit shapes: a reshape to
  // the shape an array has adds no graph node (one with -1 would, in every layer of every step).
  auto freqs = with_freqs ? mx::astype(mx::reshape(*rope.freqs, {static_cast<int>(rope.freqs->size())}), mx::float32)
                          : pos;
  const int half = D / 2;
  // with norms one block is one head (its reduction), else up to 128 threads of a head's pairs
  const int bx = norm != nullptr ? (half + 31) / 32 * 32 : std::min(half, 128);
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs{
      {"T", qkv.dtype()}, {"kH", H}, {"kKVH", KVH}, {"kD", D}, {"kDims", rope.dims},
      {"kTraditional", rope.traditional}, {"kFreqs", with_freqs}, {"kQkNorm", norm != nullptr}, {"kBlock", bx},
      {"kScaleBits", float_bits(rope.scale, "the RoPE scale")},
      {"kLog2BaseBits", float_bits(with_freqs ? 0.0f : std::log2(*rope.base), "log2 of the RoPE base")},
      {"kEpsBits", float_bits(norm != nullptr ? norm->eps : 0.0f, "the q/k RMSNorm epsilon")}};
  // without norms qkv stands in for q_w / k_w (never read; of the type T the kernel declares them)
  std::vector<mx::array> inputs{qkv, pos, freqs, norm != nullptr ? norm->q_w : qkv, norm != nullptr ? norm->k_w : qkv};
  return {std::move(inputs), std::move(targs), {((half + bx - 1) / bx) * bx, H + 2 * KVH, R}, {bx, 1, 1}};
}

}  // namespace

std::array<mx::array, 3> qkv_rope(const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope,
                                  const mx::array& positions, bool kv_write_rows, const QkNorm* norm) {
  const int R = qkv.shape(0);
  auto l = rope_launch(qkv, H, KVH, D, rope, positions, norm);
  const mx::Shape kv_shape = kv_write_rows ? mx::Shape{R * KVH, 1, 1, 1, D} : mx::Shape{R, KVH, D};
  auto out = kernel(false)(l.inputs, {{R, H, D}, kv_shape, kv_shape}, {qkv.dtype(), qkv.dtype(), qkv.dtype()},
                           l.grid, l.block, l.targs, std::nullopt, false, {});
  return {out[0], out[1], out[2]};
}

bool qkv_rope_write_supported(const mx::array& qkv, int KVH, int D, const mx::array& k_storage,
                              const mx::array& v_storage, const mx::array& slots) {
  auto fits = [&](const mx::array& s) {
    return s.ndim() == 4 && s.shape(1) == KVH && s.shape(3) == D && s.dtype() == qkv.dtype();
  };
  return qkv_rope_write_enabled() && fits(k_storage) && fits(v_storage) && k_storage.shape() == v_storage.shape() &&
         slots.ndim() == 1 && slots.shape(0) == qkv.shape(0) && slots.dtype() == mx::int32;
}

mx::array qkv_rope_write(const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope,
                         const mx::array& positions, const mx::array& k_storage, const mx::array& v_storage,
                         const mx::array& slots, const QkNorm* norm) {
  const int R = qkv.shape(0);
  auto l = rope_launch(qkv, H, KVH, D, rope, positions, norm);
  l.targs.emplace_back("kP", k_storage.shape(2));
  l.inputs.insert(l.inputs.end(), {slots, k_storage, v_storage});
  return kernel(true)(l.inputs, {{R, H, D}}, {qkv.dtype()}, l.grid, l.block, l.targs, std::nullopt, false, {})[0];
}

}  // namespace mlx_infer
