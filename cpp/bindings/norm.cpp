// nanobind only: the fused residual add + RMS norm (cpp/norm/add_rms_norm_cuda.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>

#include "../norm/add_rms_norm_cuda.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

void bind_norm(nb::module_& m) {
  m.def("add_rms_norm_supported", &mlx_infer::add_rms_norm_supported, "h"_a, "r"_a, "w"_a, "eps"_a,
        "Whether add_rms_norm takes these: MLX's CUDA backend with the GPU the default device, h and r (rows, E) "
        "and w (E,) of one float dtype, E a multiple of 4 up to 65536.");
  m.def("add_rms_norm_enabled", &mlx_infer::add_rms_norm_enabled,
        "Whether the decode graphs fuse each residual add with the norm after it (MLX_INFER_ADD_NORM=1; off by "
        "default), as the next graph build reads it.");
  m.def(
      "add_rms_norm",
      [](const mx::array& h, const mx::array& r, const mx::array& w, float eps) {
        if (!mlx_infer::add_rms_norm_supported(h, r, w, eps)) {
          throw std::invalid_argument(
              "[add_rms_norm] runs on MLX's CUDA backend (default device the GPU) with h and r (rows, E) and w (E,) "
              "of one float dtype, E a multiple of 4 up to 65536, eps >= 0; elsewhere use mx.add and "
              "mx.fast.rms_norm.");
        }
        return mlx_infer::add_rms_norm(h, r, w, eps);
      },
      "h"_a, "r"_a, "w"_a, "eps"_a,
      "``(h + r, rms_norm(h + r, w, eps))`` in one CUDA kernel, as MLX's add and mx.fast.rms_norm compute them "
      "(the decode graphs' with MLX_INFER_ADD_NORM=1). CUDA only: elsewhere a clear error.");
}
