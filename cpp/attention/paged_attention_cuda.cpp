// paged_attention's CUDA kernels, compiled at run time by NVRTC through
// mx::fast::cuda_kernel (MLX's CustomKernel primitive: it runs inside
// mx::compile'd graphs like any other op). Built in every wheel; used only
// where mx::cu::is_available().
//
// Pass 1, one block per (split, KV head, row), NW warps:
//   a warp reads KPW = 32 / LPK keys at a time, LPK lanes per key, E = D / LPK
//   contiguous elements per lane (16-byte loads for 16-bit K/V); the G query
//   heads of the KV head sit in registers (pre-scaled by scale * log2 e), so
//   each key is read once for all of them. With a soft cap (kSoftcap, the cap in
//   scale[1]) the queries are scaled by scale alone: the cap applies to the
//   natural score s, c = cap * tanh(s / cap), and c * log2 e enters the softmax.
//   Scores are reduced over the LPK lanes by shuffles; each lane group keeps its
//   own online softmax (m, l, acc[G][E], float32); groups merge by shuffles,
//   warps through shared memory.
//   A row's keys [max(0, length - window), length) are cut into gridDim.x
//   contiguous splits (flash decoding); page = block_tables[r, j / P].
// Pass 2 (only when split): per (row, head, d) the splits' (m, l, o) merge. With a ``counts`` array (the
// paged step's) the merge runs inside pass 1 instead: the split block that finishes its (row, KV head) last
// merges them (kMergeTail), one kernel and one graph node a layer fewer (each node costs MLX's host ~8 us
// for a CustomKernel, every step).
// Sinks (kSinks) join the final (M, L, A) once: in pass 1 unsplit, else in the merge.
#include "paged_attention_cuda.h"

#include <mlx/fast.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "kernel_args.h"
#include "mlx_infer/backend.h"
#include "mlx_infer/paged_attention.h"

namespace mlx_infer {

namespace {

constexpr int kWarps = 4;           // NW: warps per block of pass 1
constexpr int kTargetBlocks = 1056;  // ~8 blocks per SM of an H200 (132 SMs): split until rows x heads reach it
constexpr int kMinSplitKeys = 64;    // a split reads at least this many keys of the longest row
                                     // (MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS, read at each trace: an A/B)
constexpr int kMaxSplits = 32;
// Pass 1's key pipeline (kU, kPrefetch) where MLX_INFER_PAGED_ATTN_UNROLL / _PREFETCH are unset: the H200's
// sweep (benchmarks/gpu_paged_attention.py --sweep, session 14) has 2 sets unprefetched the fastest at 13 of 16
// serving shapes (geomean 16% under the old 1 set prefetched), 8 sets at the other 3.
constexpr int kDefaultUnroll = 2;
constexpr bool kDefaultPrefetch = false;

constexpr const char* kHeader = R"(
__device__ __forceinline__ float mlxi_scale_of(float m, float M) {
  return m == -INFINITY ? 0.0f : exp2f(m - M);
}
)";

// Pass 1. Template constants: QT KT OT (dtypes), kD kP kG kKVH kWindow kNW kLPK kE, kU (key sets per warp
// and iteration), kPrefetch (bool: the next iteration's sets load before this one's are scored), kSoftcap (bool: the
// cap is compiled away when false), kSinks (bool: the sink joins; false in a split's partial); MLXI_STORE: the
// store. kScaleBits / kCapBits: the scale and the cap, float32 bit patterns (template constants, not a device
// array: a host-made 8-byte array lives in MLX's mapped host pool, so every thread's read of it would cross to
// host memory); ``sinks``: (H,) float32 (read only with kSinks).
constexpr const char* kPass1 = R"(
  constexpr int kKPW = 32 / kLPK;
  const int split = blockIdx.x, kvh = blockIdx.y, r = blockIdx.z;
  const int splits = gridDim.x;
  const int R = q_shape[0];
  const int T = block_tables_shape[1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grp = lane / kLPK, sub = lane % kLPK;
  const int len = lengths[r];
  const int hi = min(len, T * kP);
  const int lo = kWindow > 0 ? max(0, len - kWindow) : 0;
  const int n = max(hi - lo, 0);
  const int chunk = (n + splits - 1) / splits;
  const int s_lo = lo + split * chunk;
  const int s_hi = min(hi, s_lo + chunk);

  constexpr float kMlxiLog2e = 1.4426950408889634f;
  // exp2 domain; soft-capped: the natural score first, capped, then into the exp2 domain.
  const float qscale = kSoftcap ? __int_as_float(kScaleBits) : __int_as_float(kScaleBits) * kMlxiLog2e;
  const float cap = kSoftcap ? __int_as_float(kCapBits) : 0.0f;
  const float inv_cap = kSoftcap ? 1.0f / cap : 0.0f;
  const float cap_log2e = cap * kMlxiLog2e;
  float qr[kG][kE], acc[kG][kE], m[kG], l[kG];
  #pragma unroll
  for (int g = 0; g < kG; ++g) {
    const QT* qp = q + ((size_t)r * (kKVH * kG) + kvh * kG + g) * kD + sub * kE;
    #pragma unroll
    for (int e = 0; e < kE; ++e) {
      qr[g][e] = static_cast<float>(qp[e]) * qscale;
      acc[g][e] = 0.0f;
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }

  // The loop is latency-bound (a table load, then the K/V loads it indexes, a handful of keys per warp): an
  // iteration loads kU sets of kKPW keys per warp at once (kU x the bytes in flight), and with kPrefetch the
  // next iteration's sets are loaded before this one's keys are scored (kU = 1 with kPrefetch: one set ahead).
  const int32_t* table = block_tables + (size_t)r * T;
  constexpr int kStride = kNW * kKPW;  // keys that one set of every warp covers
  constexpr int kBatch = kStride * kU;  // keys that one iteration covers
  // The kU sets at base + u * kStride (+ grp): a set past the split's end reads its last key (never scored).
  auto load = [&](int base, AlignedVector<KT, kE>* ks, AlignedVector<KT, kE>* vs) {
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int j = min(base + u * kStride + grp, s_hi - 1);
      const size_t at = (((size_t)table[j / kP] * kKVH + kvh) * kP + j % kP) * kD + sub * kE;
      ks[u] = *reinterpret_cast<const AlignedVector<KT, kE>*>(k + at);
      vs[u] = *reinterpret_cast<const AlignedVector<KT, kE>*>(v + at);
    }
  };
  int jb = s_lo + warp * kKPW;
  AlignedVector<KT, kE> kn[kU], vn[kU];  // with kPrefetch: the next iteration's sets
  if (kPrefetch && jb < s_hi) load(jb, kn, vn);
  for (; jb < s_hi; jb += kBatch) {
    AlignedVector<KT, kE> kc[kU], vc[kU];  // this iteration's sets
    if (kPrefetch) {
      #pragma unroll
      for (int u = 0; u < kU; ++u) {
        kc[u] = kn[u];
        vc[u] = vn[u];
      }
      if (jb + kBatch < s_hi) load(jb + kBatch, kn, vn);
    } else {
      load(jb, kc, vc);
    }
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int j0 = jb + u * kStride;  // the same in every lane of the warp
      if (j0 >= s_hi) break;
      const bool valid = j0 + grp < s_hi;
      float kf[kE], vf[kE];
      #pragma unroll
      for (int e = 0; e < kE; ++e) {
        kf[e] = static_cast<float>(kc[u][e]);
        vf[e] = static_cast<float>(vc[u][e]);
      }
      #pragma unroll
      for (int g = 0; g < kG; ++g) {
        float s = 0.0f;
        #pragma unroll
        for (int e = 0; e < kE; ++e) s += qr[g][e] * kf[e];
        #pragma unroll
        for (int o = kLPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (kSoftcap) s = cap_log2e * tanhf(s * inv_cap);
        if (valid) {
          const float mn = fmaxf(m[g], s);
          const float c = mlxi_scale_of(m[g], mn);
          const float p = exp2f(s - mn);
          l[g] = l[g] * c + p;
          #pragma unroll
          for (int e = 0; e < kE; ++e) acc[g][e] = acc[g][e] * c + p * vf[e];
          m[g] = mn;
        }
      }
    }
  }

  // Lane groups of one warp (same sub, other grp) merge.
  #pragma unroll
  for (int o = kLPK; o < 32; o <<= 1) {
    #pragma unroll
    for (int g = 0; g < kG; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
      const float lo_ = __shfl_xor_sync(0xffffffffu, l[g], o);
      const float mn = fmaxf(m[g], mo);
      const float c1 = mlxi_scale_of(m[g], mn), c2 = mlxi_scale_of(mo, mn);
      l[g] = l[g] * c1 + lo_ * c2;
      #pragma unroll
      for (int e = 0; e < kE; ++e) {
        const float ao = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
        acc[g][e] = acc[g][e] * c1 + ao * c2;
      }
      m[g] = mn;
    }
  }

  // Warps merge through shared memory.
  __shared__ float sm_acc[kNW * kG * kD];
  __shared__ float sm_m[kNW * kG], sm_l[kNW * kG];
  if (grp == 0) {
    #pragma unroll
    for (int g = 0; g < kG; ++g) {
      #pragma unroll
      for (int e = 0; e < kE; ++e) sm_acc[(warp * kG + g) * kD + sub * kE + e] = acc[g][e];
      if (sub == 0) {
        sm_m[warp * kG + g] = m[g];
        sm_l[warp * kG + g] = l[g];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kG * kD; idx += kNW * 32) {
    const int g = idx / kD, d = idx % kD;
    float M = -INFINITY;
    #pragma unroll
    for (int w = 0; w < kNW; ++w) M = fmaxf(M, sm_m[w * kG + g]);
    float L = 0.0f, A = 0.0f;
    #pragma unroll
    for (int w = 0; w < kNW; ++w) {
      const float c = mlxi_scale_of(sm_m[w * kG + g], M);
      L += sm_l[w * kG + g] * c;
      A += sm_acc[(w * kG + g) * kD + d] * c;
    }
    const int h = kvh * kG + g;
    float num = A, den = L;
    if (kSinks) {  // the final pass only (a split's partial has none)
      MLXI_SINK
    }
    const float o = den > 0.0f ? num / den : 0.0f;
    MLXI_STORE
  }
MLXI_TAIL
)";

// How pass 1 stores: the final output, or the split's partial (o, m, l).
constexpr const char* kStoreOut = "out[((size_t)r * (kKVH * kG) + h) * kD + d] = static_cast<OT>(o);";
constexpr const char* kStorePart = R"(
    o_part[(((size_t)split * R + r) * (kKVH * kG) + h) * kD + d] = o;
    if (d == 0) {
      ml[(((size_t)split * R + r) * (kKVH * kG) + h) * 2] = M;
      ml[(((size_t)split * R + r) * (kKVH * kG) + h) * 2 + 1] = L;
    })";

// The single-pass merge at the end of a split's pass 1 (kernel 3): after the partials are stored, the block
// that finishes its (row, KV head) last (``counts``, one int per (row, KV head), zero at launch: each block
// adds one; the last sets it back to zero for the next launch) merges the kG heads' splits as pass 2 does,
// reading the other blocks' partials from L2 (__ldcg) after the fences, eight splits' loads in flight at once
// (the loops unrolled: each split's load is independent of the last's sum). Template constant kMergeSinks (bool).
constexpr const char* kMergeTail = R"(
  __threadfence();
  __syncthreads();
  __shared__ int mlxi_last;
  if (threadIdx.x == 0) {
    int* c = (int*)counts + (size_t)r * kKVH + kvh;  // an input MLX never writes: the step's counters
    mlxi_last = atomicAdd(c, 1) == splits - 1;
    if (mlxi_last) *c = 0;
  }
  __syncthreads();
  if (!mlxi_last) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < kG * kD; idx += kNW * 32) {
    const int g = idx / kD, d = idx % kD, h = kvh * kG + g;
    float M = -INFINITY;
    #pragma unroll 8
    for (int s = 0; s < splits; ++s) M = fmaxf(M, __ldcg(ml + (((size_t)s * R + r) * (kKVH * kG) + h) * 2));
    float L = 0.0f, A = 0.0f;
    #pragma unroll 8
    for (int s = 0; s < splits; ++s) {
      const size_t i = ((size_t)s * R + r) * (kKVH * kG) + h;
      const float c = mlxi_scale_of(__ldcg(ml + i * 2), M) * __ldcg(ml + i * 2 + 1);
      L += c;
      A += c * __ldcg(o_part + i * kD + d);
    }
    float num = A, den = L;
    if (kMergeSinks) {
      MLXI_SINK
    }
    out[((size_t)r * (kKVH * kG) + h) * kD + d] = static_cast<OT>(den > 0.0f ? num / den : 0.0f);
  }
)";

// The sink (``sinks[h]``, natural log domain) joins the softmax of (M, L, A) in the exp2 domain as one more
// score with no value; every term finite, also with no keys (M = -inf: num = 0, den = 1).
constexpr const char* kSink = R"(
      const float s2 = sinks[h] * kMlxiLog2e;
      const float mx2 = fmaxf(M, s2);
      const float c = mlxi_scale_of(M, mx2);
      num = A * c;
      den = L * c + exp2f(s2 - mx2);)";

std::string with_sink(std::string src) {
  for (auto at = src.find("MLXI_SINK"); at != std::string::npos; at = src.find("MLXI_SINK")) {
    src.replace(at, 9, kSink);
  }
  return src;
}

std::string pass1(const char* store, const char* tail = "") {
  std::string src = kPass1;
  src.replace(src.find("MLXI_STORE"), 10, store);
  src.replace(src.find("MLXI_TAIL"), 9, tail);
  return with_sink(std::move(src));
}

// Pass 2: thread (d, h, r) merges the splits, then the sink joins (kSinks). Template constants: OT, kD, kH, kSinks.
constexpr const char* kPass2 = R"(
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  const int h = blockIdx.y, r = blockIdx.z;
  if (d >= kD) return;
  const int splits = o_part_shape[0], R = o_part_shape[1];
  float M = -INFINITY;
  #pragma unroll 8
  for (int s = 0; s < splits; ++s) M = fmaxf(M, ml[(((size_t)s * R + r) * kH + h) * 2]);
  float L = 0.0f, A = 0.0f;
  #pragma unroll 8
  for (int s = 0; s < splits; ++s) {
    const size_t i = ((size_t)s * R + r) * kH + h;
    const float c = mlxi_scale_of(ml[i * 2], M) * ml[i * 2 + 1];
    L += c;
    A += c * o_part[i * kD + d];
  }
  constexpr float kMlxiLog2e = 1.4426950408889634f;
  float num = A, den = L;
  if (kSinks) {
    MLXI_SINK
  }
  out[((size_t)r * kH + h) * kD + d] = static_cast<OT>(den > 0.0f ? num / den : 0.0f);
)";

struct Layout {
  int lpk = 0, e = 0;
};

Layout layout(int D) {
  Layout t;
  t.lpk = std::min(32, D / 8);
  if (t.lpk < 1 || (t.lpk & (t.lpk - 1)) != 0 || D % t.lpk != 0) {
    return {};
  }
  t.e = D / t.lpk;
  return t;
}

// 0: unsplit; 1 and 2: split, then merge (two kernels); 3: split with the merge inside (one kernel).
const ReusedKernel& kernel(int which) {
  static std::once_flag once;
  static ReusedKernel fns[4];
  std::call_once(once, [] {
    const std::vector<std::string> in{"q", "k", "v", "block_tables", "lengths", "sinks"};
    fns[0] = ReusedKernel(mx::fast::cuda_kernel("mlxi_paged_attn", in, {"out"}, pass1(kStoreOut), kHeader));
    fns[1] = ReusedKernel(
        mx::fast::cuda_kernel("mlxi_paged_attn_split", in, {"o_part", "ml"}, pass1(kStorePart), kHeader));
    fns[2] = ReusedKernel(mx::fast::cuda_kernel("mlxi_paged_attn_merge", {"o_part", "ml", "sinks"}, {"out"},
                                                with_sink(kPass2), kHeader));
    auto counted = in;
    counted.push_back("counts");
    fns[3] = ReusedKernel(mx::fast::cuda_kernel("mlxi_paged_attn_one_pass", counted, {"out", "o_part", "ml"},
                                                pass1(kStorePart, kMergeTail), kHeader));
  });
  return fns[which];
}

}  // namespace

PagedKeyPipeline paged_key_pipeline() {
  return {static_cast<int>(env_int("MLX_INFER_PAGED_ATTN_UNROLL", 1, 8, kDefaultUnroll)),
          env_int("MLX_INFER_PAGED_ATTN_PREFETCH", 0, 1, kDefaultPrefetch ? 1 : 0) == 1};
}

int paged_attention_splits(int rows, int kv_heads, int max_keys) {
  const int blocks = std::max(1, rows * kv_heads);
  int splits = (kTargetBlocks + blocks - 1) / blocks;
  const long min_keys = env_int("MLX_INFER_PAGED_ATTN_MIN_SPLIT_KEYS", 1, 1L << 20, kMinSplitKeys,
                                "the fewest keys of the longest row a split reads");
  splits = std::min({splits, kMaxSplits, std::max(1, static_cast<int>(max_keys / min_keys))});
  return std::max(1, splits);
}

bool cuda_paged_attention_supports(int H, int D, mx::Dtype q_dtype, const mx::array& k_storage) {
  const int G = H / k_storage.shape(1);
  const auto t = layout(D);
  return t.lpk > 0 && cuda_float_dtype(q_dtype) && cuda_float_dtype(k_storage.dtype()) && G * t.e <= 128 &&
         kWarps * G * D * 4 <= 40000;
}

mx::array cuda_paged_attention(const mx::array& q, const mx::array& k_storage, const mx::array& v_storage,
                               const mx::array& block_tables, const mx::array& lengths, int window, float scale,
                               float softcap, const std::optional<mx::array>& sinks, mx::Stream s,
                               bool flat_heads, const std::optional<mx::array>& split_counts) {
  const int R = q.shape(0), H = q.shape(1), D = q.shape(2);
  const mx::Shape out_shape = flat_heads ? mx::Shape{R, H * D} : q.shape();
  const int KVH = k_storage.shape(1), P = k_storage.shape(2), T = block_tables.shape(1);
  const int G = H / KVH;
  const auto t = layout(D);
  const int max_keys = window > 0 ? std::min(window, T * P) : T * P;
  const int splits = paged_attention_splits(R, KVH, max_keys);
  const bool split = splits > 1;
  const bool capped = softcap > 0.0f;
  const auto pipe = paged_key_pipeline();
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs{
      {"QT", q.dtype()}, {"KT", k_storage.dtype()}, {"OT", q.dtype()}, {"kD", D}, {"kP", P}, {"kG", G},
      {"kKVH", KVH}, {"kWindow", std::max(window, 0)}, {"kNW", kWarps}, {"kLPK", t.lpk}, {"kE", t.e},
      {"kU", pipe.unroll}, {"kPrefetch", pipe.prefetch},
      {"kSoftcap", capped}, {"kSinks", sinks.has_value() && !split},  // a split's partial has no sink
      {"kScaleBits", float_bits(scale, "the attention scale")},
      {"kCapBits", float_bits(capped ? softcap : 0.0f, "the soft cap")}};
  // sinks: (H,) float32 (the caller casts); without them the lengths stand in, never read (no extra op).
  const auto sk = sinks ? *sinks : lengths;
  std::vector<mx::array> in{q, k_storage, v_storage, block_tables, lengths, sk};
  const std::tuple<int, int, int> grid{32 * kWarps * splits, KVH, R}, block{32 * kWarps, 1, 1};
  if (!split) {
    return kernel(0)(in, {out_shape}, {q.dtype()}, grid, block, targs, std::nullopt, false, s)[0];
  }
  // The merge inside the split kernel where the step hands counters (MLX_INFER_PAGED_ATTN_ONE_PASS=0: the two
  // kernels; read at each trace). On by default since session 26 (H100): the CUDA step tests pass with it, and
  // a llama-1B step alternating both ways ran 0.97x (1 stream) and 1.01x (32 streams) the two kernels' time
  // (benchmarks/RESULTS.md, "Session 26"), one launch a layer fewer.
  if (split_counts && env_int("MLX_INFER_PAGED_ATTN_ONE_PASS", 0, 1, 1, "0: merge in a second kernel") == 1 &&
      split_counts->dtype() == mx::int32 &&
      split_counts->size() >= static_cast<size_t>(R) * static_cast<size_t>(KVH)) {
    in.push_back(*split_counts);
    targs.push_back({"kMergeSinks", sinks.has_value()});
    return kernel(3)(in, {out_shape, {splits, R, H, D}, {splits, R, H, 2}}, {q.dtype(), mx::float32, mx::float32},
                     grid, block, targs, std::nullopt, false, s)[0];
  }
  auto parts = kernel(1)(in, {{splits, R, H, D}, {splits, R, H, 2}}, {mx::float32, mx::float32}, grid, block,
                         targs, std::nullopt, false, s);
  const int bx = std::min(D, 128);
  return kernel(2)({parts[0], parts[1], sk}, {out_shape}, {q.dtype()}, {D, H, R}, {bx, 1, 1},
                   {{"OT", q.dtype()}, {"kD", D}, {"kH", H}, {"kSinks", sinks.has_value()}}, std::nullopt, false,
                   s)[0];
}

}  // namespace mlx_infer
