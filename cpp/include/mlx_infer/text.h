// Error-message text without iostreams. On the H200 image, inserting an integer into a std::ostringstream
// inside this extension crashed (SIGSEGV in std::ostream::_M_insert<long>; sessions 7 and 9: the tuned
// products' choice log and DecodeStep's capacity error), so messages are built from std::to_string.
#pragma once

#include <mlx/array.h>

#include <string>

namespace mlx_infer {

/// "(2, 8, 64)": an array's shape as MLX prints it.
inline std::string shape_text(const mlx::core::Shape& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + ")";
}

/// "bfloat16": a dtype's name.
inline std::string dtype_text(mlx::core::Dtype dtype) {
  namespace mx = mlx::core;
  switch (dtype.val()) {
    case mx::Dtype::Val::bool_: return "bool";
    case mx::Dtype::Val::uint8: return "uint8";
    case mx::Dtype::Val::uint16: return "uint16";
    case mx::Dtype::Val::uint32: return "uint32";
    case mx::Dtype::Val::uint64: return "uint64";
    case mx::Dtype::Val::int8: return "int8";
    case mx::Dtype::Val::int16: return "int16";
    case mx::Dtype::Val::int32: return "int32";
    case mx::Dtype::Val::int64: return "int64";
    case mx::Dtype::Val::float16: return "float16";
    case mx::Dtype::Val::float32: return "float32";
    case mx::Dtype::Val::float64: return "float64";
    case mx::Dtype::Val::bfloat16: return "bfloat16";
    case mx::Dtype::Val::complex64: return "complex64";
  }
  return "dtype of " + std::to_string(dtype.size()) + " bytes";
}

}  // namespace mlx_infer
