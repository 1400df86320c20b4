// Helpers the primitives share: dtype mapping, contiguity, the GPU guard.
#pragma once

#include <mlx/mlx.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

namespace mlx_infer {

namespace mx = mlx::core;

namespace detail {

using cpu::ElemType;

inline bool kernel_dtype(mx::Dtype t) {
  return t == mx::float32 || t == mx::bfloat16 || t == mx::float16;
}

inline ElemType elem_type(mx::Dtype t) {
  if (t == mx::float32) {
    return ElemType::f32;
  }
  return t == mx::bfloat16 ? ElemType::bf16 : ElemType::f16;
}

inline bool on_cpu(const mx::Stream& s) { return s.device == mx::Device::cpu; }

// Row-contiguous bytes of `a`: its own buffer, or a gathered copy in `buf` (the
// kernels index rows as dense blocks, as MLX's CPU matmuls copy strided inputs).
inline const void* contiguous_bytes(const mx::array& a, std::vector<uint8_t>& buf) {
  if (a.flags().row_contiguous) {
    return a.data<uint8_t>();
  }
  const size_t item = a.itemsize();
  buf.resize(a.size() * item);
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = static_cast<int>(shape.size());
  const uint8_t* src = a.data<uint8_t>();
  std::vector<int64_t> idx(nd, 0);
  int64_t offset = 0;  // elements
  for (size_t i = 0; i < a.size(); ++i) {
    std::memcpy(buf.data() + i * item, src + offset * static_cast<int64_t>(item), item);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        offset += strides[d];
        break;
      }
      offset -= strides[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
  return buf.data();
}

[[noreturn]] inline void gpu_unreachable(const char* name) {
  throw std::runtime_error(
      std::string("[") + name +
      "] is a CPU-only primitive; the mlx_infer ops build MLX's own op for GPU streams, so "
      "this graph was built by hand on the wrong stream.");
}

}  // namespace detail

}  // namespace mlx_infer
