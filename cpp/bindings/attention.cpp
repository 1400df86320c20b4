// nanobind only: attention sizing bindings (Geometry and workspace arithmetic).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <new>
#include <string>

#include "mlx_infer/attention.h"

namespace nb = nanobind;
using namespace nb::literals;
using mlx_infer::Geometry;

void bind_attention(nb::module_& m) {
  nb::class_<Geometry>(
      m, "Geometry",
      "A model's attention shape, as the workspace and KV sizing functions need it.")
      .def(
          "__init__",
          [](Geometry* g, int n_heads, int n_kv_heads, int head_dim, int n_layers,
             std::vector<int> layer_windows, int dtype_bytes) {
            Geometry value{n_heads, n_kv_heads, head_dim, n_layers,
                           std::move(layer_windows), dtype_bytes};
            mlx_infer::validate_geometry(value);
            new (g) Geometry(std::move(value));
          },
          nb::kw_only(), "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "n_layers"_a,
          "layer_windows"_a = std::vector<int>{}, "dtype_bytes"_a = 2,
          R"(Args:
    n_heads: query heads.
    n_kv_heads: key/value heads (divides n_heads).
    head_dim: per-head width.
    n_layers: attention layers.
    layer_windows: sliding window per layer, 0 = global; empty = all global.
    dtype_bytes: bytes per activation / KV element (bf16: 2, f32: 4).)")
      .def_ro("n_heads", &Geometry::n_heads)
      .def_ro("n_kv_heads", &Geometry::n_kv_heads)
      .def_ro("head_dim", &Geometry::head_dim)
      .def_ro("n_layers", &Geometry::n_layers)
      .def_ro("layer_windows", &Geometry::layer_windows)
      .def_ro("dtype_bytes", &Geometry::dtype_bytes)
      .def("__repr__", [](const Geometry& g) {
        int windowed = 0;
        for (int w : g.layer_windows) {
          windowed += w > 0;
        }
        return "Geometry(n_heads=" + std::to_string(g.n_heads) +
               ", n_kv_heads=" + std::to_string(g.n_kv_heads) +
               ", head_dim=" + std::to_string(g.head_dim) +
               ", n_layers=" + std::to_string(g.n_layers) +
               ", windowed_layers=" + std::to_string(windowed) +
               ", dtype_bytes=" + std::to_string(g.dtype_bytes) + ")";
      });

  m.attr("DEFAULT_WORKSPACE_BUDGET") = mlx_infer::kDefaultWorkspaceBudget;

  m.def("sdpa_fallback_bytes", &mlx_infer::sdpa_fallback_bytes, "geometry"_a,
        nb::kw_only(), "chunk"_a, "prompt_tokens"_a,
        R"(Bound on the transient attention-score bytes of one layer's
unfused SDPA for the last chunk of a prompt (max over layers)::

    queries = min(chunk, prompt_tokens)
    keys    = prompt_tokens                          (global layer)
            = min(prompt_tokens, window + chunk)     (windowed layer)
    bytes   = n_heads * queries * keys * (4 + dtype_bytes)

i.e. float32 scores plus the softmax output. MLX on CPU measures about
``n_heads * queries * keys * dtype_bytes`` (it reuses the score buffer).)");

  m.def("prefill_chunk_size", &mlx_infer::prefill_chunk_size, "geometry"_a,
        "prompt_tokens"_a, nb::kw_only(),
        "budget_bytes"_a = mlx_infer::kDefaultWorkspaceBudget, "explicit"_a = 0,
        R"(Prefill chunk: ``explicit`` (> 0) exactly; otherwise 2048, halved
while ``sdpa_fallback_bytes`` exceeds ``budget_bytes`` (1 GiB default), never
below 8. Changes work size, never admission.)");

  m.def("kv_bytes_per_token", &mlx_infer::kv_bytes_per_token, "geometry"_a,
        nb::kw_only(), "kv_bits"_a = 16, "group_size"_a = 64,
        R"(KV bytes one token adds across all layers (inside every window).

``kv_bits`` 16 or 32: plain elements of that width (``dtype_bytes`` unused);
2, 3, 4, 5, 6 or 8: MLX affine quantization, ``head_dim * kv_bits / 8``
packed bytes plus a scale and a bias of ``dtype_bytes`` per ``group_size``
elements, for K and for V of each KV head.)");

  m.def("kv_bytes_for_context", &mlx_infer::kv_bytes_for_context, "geometry"_a,
        "tokens"_a, nb::kw_only(), "kv_bits"_a = 16, "group_size"_a = 64,
        "KV bytes of a ``tokens``-long context; windowed layers hold at most their window.");

  m.def("max_context_for_budget", &mlx_infer::max_context_for_budget, "geometry"_a,
        "budget_bytes"_a, nb::kw_only(), "kv_bits"_a = 16, "group_size"_a = 64,
        R"(The longest context whose KV fits in ``budget_bytes``, or None when
every layer is windowed and all windows fit (unbounded context).)");
}
