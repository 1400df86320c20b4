// Scalar element conversions shared by every kernel variant (portable C++).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace mlx_infer::cpu {

struct bf16_t {
  uint16_t v;
};
struct f16_t {
  uint16_t v;
};

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float to_f32(float v) { return v; }
inline float to_f32(bf16_t v) { return bits_to_f32(static_cast<uint32_t>(v.v) << 16); }
inline float to_f32(f16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h.v & 0x8000u) << 16;
  const uint32_t exp = (h.v >> 10) & 0x1fu;
  uint32_t mant = h.v & 0x3ffu;
  if (exp == 0x1f) {  // inf / nan
    return bits_to_f32(sign | 0x7f800000u | (mant << 13));
  }
  if (exp == 0) {
    if (mant == 0) {
      return bits_to_f32(sign);
    }
    int e = -1;  // subnormal: normalise
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    return bits_to_f32(sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13);
  }
  return bits_to_f32(sign | (exp + 112u) << 23 | mant << 13);
}

/// Round to nearest even, as MLX's float -> bfloat16 cast does.
inline bf16_t to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40u)};
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{static_cast<uint16_t>(u >> 16)};
}

/// Round to nearest even (IEEE binary16), with overflow to inf.
inline f16_t to_f16(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7fffffffu;
  if (au >= 0x7f800000u) {  // inf / nan
    return f16_t{static_cast<uint16_t>(sign | 0x7c00u | (au > 0x7f800000u ? 0x200u : 0u))};
  }
  if (au >= 0x477ff000u) {  // rounds to >= 65520: inf
    return f16_t{static_cast<uint16_t>(sign | 0x7c00u)};
  }
  if (au < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (au < 0x33000000u) {
      return f16_t{sign};
    }
    const uint32_t e = au >> 23;
    const uint32_t mant = (au & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) {
      ++r;
    }
    return f16_t{static_cast<uint16_t>(sign | r)};
  }
  uint32_t r = au - 0x38000000u;  // rebias exponent 127 -> 15 (in place)
  r += 0xfffu + ((r >> 13) & 1u);
  return f16_t{static_cast<uint16_t>(sign | (r >> 13))};
}

inline float load_elem(const void* p, ElemType t, int64_t i) {
  switch (t) {
    case ElemType::f32:
      return static_cast<const float*>(p)[i];
    case ElemType::bf16:
      return to_f32(static_cast<const bf16_t*>(p)[i]);
    default:
      return to_f32(static_cast<const f16_t*>(p)[i]);
  }
}

inline void store_elem(void* p, ElemType t, int64_t i, float v) {
  switch (t) {
    case ElemType::f32:
      static_cast<float*>(p)[i] = v;
      break;
    case ElemType::bf16:
      static_cast<bf16_t*>(p)[i] = to_bf16(v);
      break;
    default:
      static_cast<f16_t*>(p)[i] = to_f16(v);
      break;
  }
}

/// Writes one output element: adds the bias (if any) and rounds to the output dtype.
struct OutWriter {
  void* out;
  ElemType out_type;
  int64_t N;
  const void* bias;
  ElemType bias_type;

  void put(int64_t m, int64_t n, float v) const {
    if (bias != nullptr) {
      v += load_elem(bias, bias_type, n);
    }
    store_elem(out, out_type, m * N + n, v);
  }
};

}  // namespace mlx_infer::cpu
