// A stand-in for {fmt}'s fmt::format, for the one translation unit that includes MLX's CUDA backend headers
// (cpp/matmul/cublas_product.cpp): mlx/backend/cuda/lru_cache.h includes <fmt/format.h> for an error message,
// and MLX's CUDA wheel ships no fmt headers. Supports "{}" placeholders only (what those headers use); the
// rest of a "{...}" spec is ignored. Not a general replacement: nothing else in mlx-infer includes it.
#pragma once

#include <sstream>
#include <string>
#include <string_view>
#include <utility>

namespace fmt {

namespace shim_detail {

inline void append_until_placeholder(std::ostringstream& out, std::string_view& f) {
  const auto open = f.find('{');
  if (open == std::string_view::npos) {
    out << f;
    f = {};
    return;
  }
  out << f.substr(0, open);
  const auto close = f.find('}', open);
  f = close == std::string_view::npos ? std::string_view{} : f.substr(close + 1);
}

}  // namespace shim_detail

template <typename... Args>
std::string format(std::string_view f, Args&&... args) {
  std::ostringstream out;
  ((shim_detail::append_until_placeholder(out, f), out << std::forward<Args>(args)), ...);
  out << f;
  return out.str();
}

}  // namespace fmt
