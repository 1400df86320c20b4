// The portable kernels: plain C++ over one float "lane" (the compiler may still
// auto-vectorize). Used on CPUs without AVX2+FMA and on non-x86 hosts.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <cmath>
#include <type_traits>
#include <vector>

#include "elem.h"
#include "kernels.h"
#include "threadpool.h"

namespace mlx_infer::cpu::generic {

struct S {
  static constexpr int W = 1;
  static constexpr int NV = 4;
  static constexpr int MR = 4;
  using V = float;
  static V zero() { return 0.0f; }
  static V set1(float a) { return a; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V add(V a, V b) { return a + b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static float reduce(V v) { return v; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V max(V a, V b) { return a > b ? a : b; }
  static float reduce_max(V v) { return v; }
  static V exp(V x) { return x < -87.3f ? 0.0f : std::exp(x); }
  static V load_bf16(const uint16_t* p) { return to_f32(bf16_t{*p}); }
  static V load_f16(const uint16_t* p) { return to_f32(f16_t{*p}); }
  static void q4(const uint8_t* p, V& lo, V& hi) {
    lo = static_cast<float>(p[0] & 15);
    hi = static_cast<float>(p[0] >> 4);
  }
  static V q8(const uint8_t* p) { return static_cast<float>(p[0]); }
};

#include "kernels_body.inc"

}  // namespace mlx_infer::cpu::generic
