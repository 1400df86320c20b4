// add_rms_norm (fused_cuda.h): a residual add and the RMSNorm after it in one CUDA kernel; with a sandwich norm
// (gemma) the branch's own RMSNorm before the add too.
//
// Every layer of a decode step ends its attention and its MLP with h + r followed by the next block's RMSNorm
// (Add then RMSNorm: two graph nodes, two launches, the sum written and read back). Here one block a row:
// each thread keeps kPer 16-byte chunks of the sum in registers, rounds each element to the dtype as MLX's add
// does, writes the sum, adds the squares of the rounded values in float32; a warp shuffle and a shared-memory
// pass give every thread the row's total; then y = w * dtype(x * rsqrt(total / E + eps)) as
// mlx/backend/cuda/rms_norm.cu computes it (the product by w in the dtype).
#include "fused_cuda.h"

#include <mlx/fast.h>

#include <algorithm>
#include <mutex>

#include "../attention/kernel_args.h"
#include "mlx_infer/backend.h"

namespace mlx_infer {

namespace {

// Template constants: T (dtype), kE (row length), kBlock (threads, a multiple of 32), kPer (chunks a thread
// holds: kBlock * kPer * (16 / sizeof(T)) >= kE), kEpsBits (eps as float32 bits: kernel_args.h), kPreNorm (r
// RMS-normed by pw first: the sandwich norm), kClip (the sum in float32 clipped to float16's range: gemma3's
// float16 residual). h, r (R, kE), w, pw (kE,); outputs sum_out, norm_out (R, kE). Grid (kBlock, R):
// blockIdx.y is the row.
constexpr const char* kAddRmsNorm = R"(
  constexpr int kC = 16 / sizeof(T);  // elements per 16-byte chunk
  using V = AlignedVector<T, kC>;
  constexpr int kChunks = kE / kC;
  const int t = threadIdx.x;
  const size_t base = (size_t)blockIdx.y * kChunks;
  const V* hv = reinterpret_cast<const V*>(h) + base;
  const V* rv = reinterpret_cast<const V*>(r) + base;
  V* sv = reinterpret_cast<V*>(sum_out) + base;
  const float eps = __int_as_float(kEpsBits);
  V s[kPer];
  float inv_r = 0.0f;
  if (kPreNorm) {  // r's own RMSNorm first: its sum of squares over the row, r kept in s meanwhile
    float sr = 0.0f;
    #pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int c = t + i * kBlock;
      if (c < kChunks) {
        s[i] = rv[c];
        #pragma unroll
        for (int e = 0; e < kC; ++e) {
          const float f = static_cast<float>(s[i][e]);
          sr += f * f;
        }
      }
    }
    __shared__ float warp_sums_r[kBlock / 32];
    inv_r = rsqrtf(block_sum<kBlock>(sr, warp_sums_r) / static_cast<float>(kE) + eps);
  }
  const V* pwv = reinterpret_cast<const V*>(pw);
  float ss = 0.0f;
  #pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = t + i * kBlock;
    if (c < kChunks) {
      const V a = hv[c];
      const V b = kPreNorm ? s[i] : rv[c];
      V pwc;
      if (kPreNorm) pwc = pwv[c];
      #pragma unroll
      for (int e = 0; e < kC; ++e) {
        float y = static_cast<float>(b[e]);
        if (kPreNorm) {  // as mx::fast::rms_norm: w * dtype(r * inv), in the dtype
          y = static_cast<float>(static_cast<T>(static_cast<float>(pwc[e]) * static_cast<float>(static_cast<T>(y * inv_r))));
        }
        float sum = static_cast<float>(a[e]) + y;
        if (kClip) sum = fminf(fmaxf(sum, -65504.0f), 65504.0f);
        s[i][e] = static_cast<T>(sum);
        const float f = static_cast<float>(s[i][e]);
        ss += f * f;
      }
      sv[c] = s[i];
    }
  }
  __shared__ float warp_sums[kBlock / 32];  // apart from warp_sums_r: no thread waits between the two sums
  const float inv = rsqrtf(block_sum<kBlock>(ss, warp_sums) / static_cast<float>(kE) + eps);
  const V* wv = reinterpret_cast<const V*>(w);
  V* nv = reinterpret_cast<V*>(norm_out) + base;
  #pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = t + i * kBlock;
    if (c < kChunks) {
      const V wc = wv[c];
      V o;
      #pragma unroll
      for (int e = 0; e < kC; ++e) {
        const T y = static_cast<T>(static_cast<float>(s[i][e]) * inv);
        o[e] = static_cast<T>(static_cast<float>(wc[e]) * static_cast<float>(y));
      }
      nv[c] = o;
    }
  }
)";

const ReusedKernel& kernel() {
  static std::once_flag once;
  static ReusedKernel fn;
  std::call_once(once, [] {
    fn = ReusedKernel(mx::fast::cuda_kernel("mlxi_add_rms_norm", {"h", "r", "w", "pw"}, {"sum_out", "norm_out"},
                                            kAddRmsNorm, kBlockSumHeader));
  });
  return fn;
}

constexpr int kMaxBlock = 1024;
constexpr int kMaxPer = 16;
constexpr int kMaxRows = 65535;  // the grid's y extent

}  // namespace

bool fused_add_norm_enabled() {
  return env_int("MLX_INFER_FUSED_ADD_NORM", 0, 1, 1, "0: the residual add and the next RMSNorm as two ops") == 1;
}

int fused_norm_max_rows() {
  return static_cast<int>(env_int("MLX_INFER_FUSED_NORM_MAX_ROWS", 0, 1L << 30, 256,
                                  "the most rows of a step that takes add_rms_norm and qkv_rope's q/k norms"));
}

bool add_rms_norm_applies(const mx::array& h, const mx::array& r, const mx::array& w, const mx::array* pre_w) {
  if (!cuda_backend() || mx::default_device() != mx::Device::gpu) {
    return false;
  }
  if (h.ndim() != 2 || r.shape() != h.shape() || w.ndim() != 1 || w.shape(0) != h.shape(1) ||
      !cuda_float_dtype(h.dtype()) || r.dtype() != h.dtype() || w.dtype() != h.dtype() || h.shape(0) < 1 ||
      h.shape(0) > kMaxRows) {
    return false;
  }
  if (pre_w != nullptr && (pre_w->shape() != w.shape() || pre_w->dtype() != h.dtype())) {
    return false;
  }
  const int per_chunk = 16 / static_cast<int>(mx::size_of(h.dtype()));
  const int E = h.shape(1);
  return E > 0 && E % per_chunk == 0 && E / per_chunk <= kMaxBlock * kMaxPer;
}

std::pair<mx::array, mx::array> add_rms_norm(const mx::array& h, const mx::array& r, const mx::array& w,
                                             float eps, const mx::array* pre_w, bool clip_f16) {
  const int R = h.shape(0), E = h.shape(1);
  const int chunks = E / (16 / static_cast<int>(mx::size_of(h.dtype())));
  const int block = std::min(kMaxBlock, (chunks + 31) / 32 * 32);
  const int per = (chunks + block - 1) / block;
  auto out = kernel()({h, r, w, pre_w != nullptr ? *pre_w : w}, {{R, E}, {R, E}}, {h.dtype(), h.dtype()},
                      {block, R, 1}, {block, 1, 1},
                      {{"T", h.dtype()}, {"kE", E}, {"kBlock", block}, {"kPer", per},
                       {"kEpsBits", float_bits(eps, "the RMSNorm epsilon")}, {"kPreNorm", pre_w != nullptr},
                       {"kClip", pre_w != nullptr && clip_f16 && h.dtype() == mx::float16}},
                      std::nullopt, false, {});
  return {out[0], out[1]};  // (R, E) each: h + r (or h + rms(r, pre_w)), its norm
}

}  // namespace mlx_infer
