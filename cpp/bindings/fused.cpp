// nanobind only: the decode graphs' fused CUDA kernels (cpp/fused/), for tests and probes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "../fused/fused_cuda.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

void bind_fused(nb::module_& m) {
  m.def("fused_add_norm_enabled", &mlx_infer::fused_add_norm_enabled,
        "Whether the decode graphs fuse the residual add and the next RMSNorm on CUDA (default on; "
        "MLX_INFER_FUSED_ADD_NORM=0 off, read at each trace; a bad value raises ValueError naming it).");
  m.def("fused_norm_max_rows", &mlx_infer::fused_norm_max_rows,
        "The most rows of a step whose graph takes add_rms_norm and qkv_rope's q/k norms on CUDA (default 256: "
        "every decode-only step; MLX_INFER_FUSED_NORM_MAX_ROWS, 0 never, read at each trace; a bad value raises "
        "ValueError naming it). Larger steps (prompt chunks) take MLX's ops, whose buffers CUDA graphs hold less.");
  m.def("fused_gated_enabled", &mlx_infer::fused_gated_enabled,
        "Whether the decode graphs take the gated activation straight from gate|up on CUDA (default on; "
        "MLX_INFER_FUSED_GATED=0 off, read at each trace; a bad value raises ValueError naming it).");
  m.def(
      "add_rms_norm",
      [](const mx::array& h, const mx::array& r, const mx::array& w, float eps, const std::optional<mx::array>& pre_w,
         bool clip_f16) {
        const mx::array* pre = pre_w ? &*pre_w : nullptr;
        if (!mlx_infer::add_rms_norm_applies(h, r, w, pre)) {
          throw std::invalid_argument(
              "[add_rms_norm] runs on MLX's CUDA backend (default device the GPU) "
              "with h and r (R, E) and w (and pre_w) (E,) of one float dtype, E a multiple of 16 bytes; elsewhere "
              "the graphs use mx.add and mx.fast.rms_norm.");
        }
        return mlx_infer::add_rms_norm(h, r, w, eps, pre, clip_f16);
      },
      "h"_a, "r"_a, "w"_a, nb::kw_only(), "eps"_a, "pre_w"_a = nb::none(), "clip_f16"_a = false,
      "``(h + r, mx.fast.rms_norm(h + r, w, eps))`` for ``h, r (R, E)`` in one CUDA kernel (the decode graphs' "
      "residual and the next norm). With ``pre_w`` (a sandwich norm, gemma) ``r`` is first "
      "``mx.fast.rms_norm(r, pre_w, eps)``; with ``clip_f16`` a float16 sum is taken in float32 and clipped to "
      "float16's range (gemma3's residual). CUDA only: elsewhere a clear error.");
  m.def(
      "gated_activation",
      [](const mx::array& gate_up, const std::string& activation) {
        if (!mlx_infer::gated_activation_applies(gate_up, activation)) {
          throw std::invalid_argument(
              "[gated_activation] runs on MLX's CUDA backend (default device the GPU) with gate_up (R, 2F) of a "
              "float dtype, F a multiple of 16 bytes, and activation 'silu' or "
              "'gelu_tanh' (got '" + activation + "'); elsewhere the graphs split and use MLX's ops.");
        }
        return mlx_infer::gated_activation(gate_up, activation);
      },
      "gate_up"_a, nb::kw_only(), "activation"_a = "silu",
      "``act(gate) * up`` for ``gate_up (R, 2F) = [gate | up]`` -> ``(R, F)`` in one CUDA kernel: 'silu' "
      "(SwiGLU) or 'gelu_tanh' (GeGLU), rounded as MLX's compiled ops round. CUDA only: elsewhere a clear error.");
}
