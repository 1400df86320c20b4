// The x86 kernels: the same body (kernels_body.inc) compiled for AVX2+FMA and for
// AVX-512, each under a target pragma, so the library itself needs only the
// baseline ISA and picks a variant at run time (kernels.cpp).
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <cmath>
#include <type_traits>
#include <vector>

#include "elem.h"
#include "kernels.h"
#include "threadpool.h"

// ---------------------------------------------------------------- AVX2 + FMA + F16C
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace mlx_infer::cpu::avx2 {

struct S {
  static constexpr int W = 8;
  static constexpr int NV = 2;
  static constexpr int MR = 6;  // 12 accumulators + 2 panel loads + 1 broadcast of 16 ymm
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float reduce(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // Cephes expf (~1 ulp); inputs below -87.3 give exactly 0 (masked scores).
  static V exp(V x) {
    const V lo = _mm256_set1_ps(-87.3f);
    const V under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3f));
    const V fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    V y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
  }
  static V load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void q4(const uint8_t* p, V& lo, V& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  static V q8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
};

#include "kernels_body.inc"

}  // namespace mlx_infer::cpu::avx2

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------- AVX-512 (F, BW, VL, DQ)
#if defined(__clang__)
#pragma clang attribute push(                                                          \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

namespace mlx_infer::cpu::avx512 {

struct S {
  static constexpr int W = 16;
  static constexpr int NV = 2;
  static constexpr int MR = 12;  // 24 accumulators + 2 panel loads + 1 broadcast of 32 zmm
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float reduce_max(V v) {
    __m256 h = _mm256_max_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // Cephes expf (~1 ulp); inputs below -87.3 give exactly 0 (masked scores).
  static V exp(V x) {
    const V lo = _mm512_set1_ps(-87.3f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.3f));
    const V fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    V y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, fx));
  }
  static float reduce(V v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V load_bf16(const uint16_t* p) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void q4(const uint8_t* p, V& lo, V& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  static V q8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

#include "kernels_body.inc"

}  // namespace mlx_infer::cpu::avx512

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------- AVX-512 VNNI (quantized GEMV)
//
// Decode-time quantized products are bound by unpacking: the float path spends
// a zero-extend and two int->float converts per 32 weights. With VNNI the
// weights stay bytes: x is quantized to int8 per 32 values (as llama.cpp's
// Q8_0) and vpdpbusd multiplies 64 weight bytes by 64 x bytes per instruction;
// the int32 sums are scaled by scale * dx once per 64 weights. The bias term
// uses the sums of the same rounded x.
//
//   4-bit chunk of 64 weights = 32 packed bytes, broadcast to both zmm halves:
//     low half  & 0x0f -> q[k = 0, 2, .., 62]     (dword lanes 0-7)
//     high half >> 4   -> q[k = 1, 3, .., 63]     (dword lanes 8-15)
//   x int8 is stored in the same order, so lane j sums 4 matching products.
#if defined(__clang__)
#pragma clang attribute push(                                                                     \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif

namespace mlx_infer::cpu::avx512vnni {

namespace {

constexpr int kMaxRows = 4;

inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

// x rows as int8 in chunk order, the per-lane dx of every chunk, exact group sums.
struct QuantizedX {
  std::vector<int8_t> q;   // (M, K)
  std::vector<float> dxv;  // (M, K / 64, 16)
  std::vector<float> xs;   // (M, G)
};

template <int BITS>
void quantize_x(const QuantProblem& p, QuantizedX& qx) {
  const int64_t K = p.K, C = K / 64, G = K / p.group_size;
  qx.q.resize(static_cast<size_t>(p.M * K));
  qx.dxv.resize(static_cast<size_t>(p.M * C * 16));
  qx.xs.resize(static_cast<size_t>(p.M * G));
  std::vector<float> xf(static_cast<size_t>(K));
  std::vector<int8_t> xn(static_cast<size_t>(K));
  std::vector<float> dxs(static_cast<size_t>(K / 32));
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      xf[k] = load_elem(p.x, p.x_type, m * K + k);
    }
    float dx[2];
    for (int64_t c = 0; c < C; ++c) {
      for (int b = 0; b < 2; ++b) {
        const float* blk = xf.data() + c * 64 + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) {
          amax = std::max(amax, std::fabs(blk[i]));
        }
        dx[b] = amax / 127.0f;
        dxs[c * 2 + b] = dx[b];
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < 32; ++i) {
          xn[c * 64 + b * 32 + i] = static_cast<int8_t>(std::nearbyint(blk[i] * inv));
        }
      }
      int8_t* dst = qx.q.data() + m * K + c * 64;
      float* lanes = qx.dxv.data() + (m * C + c) * 16;
      for (int i = 0; i < 32; ++i) {
        if constexpr (BITS == 4) {
          dst[i] = xn[c * 64 + 2 * i];
          dst[32 + i] = xn[c * 64 + 2 * i + 1];
        } else {
          dst[i] = xn[c * 64 + i];
          dst[32 + i] = xn[c * 64 + 32 + i];
        }
      }
      for (int l = 0; l < 16; ++l) {
        // 4-bit: lanes 0-3 and 8-11 hold k < 32 of the chunk; 8-bit: lanes 0-7.
        const bool second = BITS == 4 ? (l & 4) != 0 : l >= 8;
        lanes[l] = dx[second ? 1 : 0];
      }
    }
    // Sums of the int8-rounded x, not of x: then every weight sees the same
    // rounded x_k in both terms, and the error is sum_k w_k (x^_k - x_k),
    // weighted by w rather than by the unsigned q in 0..15.
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int i = 0; i < p.group_size; ++i) {
        const int64_t k = g * p.group_size + i;
        s += static_cast<float>(xn[k]) * dxs[k / 32];
      }
      qx.xs[m * G + g] = s;
    }
  }
}

template <int MC, int R, int BITS, class ST>
inline void rows_block(const QuantizedX& qx, const QuantProblem& p, int64_t n0, const OutWriter& out) {
  const int64_t K = p.K, C = K / 64;
  const int gs = p.group_size;
  const int64_t G = K / gs;
  const int64_t row_bytes = K * BITS / 8;
  const ST* scales = static_cast<const ST*>(p.scales) + n0 * G;
  const ST* biases = static_cast<const ST*>(p.biases) + n0 * G;
  const uint8_t* rows = p.w + n0 * row_bytes;
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __mmask16 second = BITS == 4 ? 0xf0f0 : 0xff00;  // lanes of the chunk's second 32 k
  __m512 acc[R][MC];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int m = 0; m < MC; ++m) {
      acc[r][m] = _mm512_setzero_ps();
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    __m512i xq[MC];
    __m512 dx[MC];
#pragma GCC unroll 4
    for (int m = 0; m < MC; ++m) {
      xq[m] = _mm512_loadu_si512(qx.q.data() + m * K + c * 64);
      dx[m] = _mm512_loadu_ps(qx.dxv.data() + (m * C + c) * 16);
    }
    const int64_t g0 = c * 64 / gs;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = rows + r * row_bytes;
      __m512i w;
      if constexpr (BITS == 4) {
        const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32)));
        w = _mm512_and_si512(_mm512_srlv_epi16(b, shifts), nib);
      } else {
        w = _mm512_loadu_si512(row + c * 64);
      }
      __m512 sv = _mm512_set1_ps(to_f32(scales[r * G + g0]));
      if (gs == 32) {
        sv = _mm512_mask_blend_ps(second, sv, _mm512_set1_ps(to_f32(scales[r * G + g0 + 1])));
      }
#pragma GCC unroll 4
      for (int m = 0; m < MC; ++m) {
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq[m]);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, dx[m]), acc[r][m]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int m = 0; m < MC; ++m) {
      float bsum = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        bsum += to_f32(biases[r * G + g]) * qx.xs[m * G + g];
      }
      out.put(m, n0 + r, reduce(acc[r][m]) + bsum);
    }
  }
}

template <int MC, int BITS, class ST>
void gemv(const QuantizedX& qx, const QuantProblem& p, const OutWriter& out) {
  constexpr int R = MC == 1 ? 4 : (MC == 2 ? 2 : 1);
  const int threads = pool().size();
  int64_t per = p.N / (static_cast<int64_t>(threads) * 8);
  per = std::min<int64_t>(512, std::max<int64_t>(8, (per + 7) / 8 * 8));
  const int64_t n_tasks = (p.N + per - 1) / per;
  const std::function<void(int64_t)> task = [&](int64_t t) {
    const int64_t n1 = std::min(p.N, (t + 1) * per);
    int64_t n = t * per;
    for (; n + R <= n1; n += R) {
      rows_block<MC, R, BITS, ST>(qx, p, n, out);
    }
    for (; n < n1; ++n) {
      rows_block<MC, 1, BITS, ST>(qx, p, n, out);
    }
  };
  if (p.M * p.N * p.K < (int64_t{1} << 22)) {  // as kSerialWork in kernels_body.inc
    for (int64_t t = 0; t < n_tasks; ++t) {
      task(t);
    }
  } else {
    pool().parallel_for(n_tasks, task);
  }
}

template <int BITS, class ST>
void typed(const QuantProblem& p, const OutWriter& out) {
  QuantizedX qx;
  quantize_x<BITS>(p, qx);
  switch (p.M) {
    case 1: gemv<1, BITS, ST>(qx, p, out); break;
    case 2: gemv<2, BITS, ST>(qx, p, out); break;
    case 3: gemv<3, BITS, ST>(qx, p, out); break;
    default: gemv<4, BITS, ST>(qx, p, out); break;
  }
}

}  // namespace

bool quant_gemv(const QuantProblem& p) {
  if (p.M > kMaxRows || p.K % 64 != 0) {
    return false;
  }
  const OutWriter out{p.out, p.out_type, p.N, nullptr, ElemType::f32};
  const bool four = p.bits == 4;
  switch (p.sb_type) {
    case ElemType::f32: four ? typed<4, float>(p, out) : typed<8, float>(p, out); break;
    case ElemType::bf16: four ? typed<4, bf16_t>(p, out) : typed<8, bf16_t>(p, out); break;
    default: four ? typed<4, f16_t>(p, out) : typed<8, f16_t>(p, out); break;
  }
  return true;
}

}  // namespace mlx_infer::cpu::avx512vnni

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // x86_64
