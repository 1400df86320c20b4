// nanobind only: argument adaptation and docstrings; the logic lives in cpp/<area>/.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "mlx_infer/kv.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

// Defined in cpp/bindings/<area>.cpp, one per area.
void bind_kv(nb::module_& m);
void bind_attention(nb::module_& m);
void bind_decode(nb::module_& m);
void bind_matmul(nb::module_& m);
void bind_paged_attention(nb::module_& m);
void bind_diagnostics(nb::module_& m);
void bind_fused(nb::module_& m);

NB_MODULE(_fast, m) {
  m.doc() = "mlx-infer's C++ core over the MLX C++ API.";

  m.def("built_mlx_version", []() { return std::string(MLX_INFER_BUILT_MLX_VERSION); },
        "The MLX version this extension was compiled against.");

  m.def(
      "slot_mapping",
      [](const mx::array& block_tables, const mx::array& positions, int page_size) {
        return mlx_infer::slot_mapping(block_tables, positions, page_size);
      },
      "block_tables"_a, "positions"_a, nb::kw_only(), "page_size"_a,
      R"(Flat KV write slots for tokens of paged sequences.

Args:
    block_tables: ``(B, max_pages)`` int32 page ids, one row per sequence.
    positions: ``(B, L)`` int32 token positions within each sequence.
    page_size: tokens per page.

Returns:
    ``(B, L)`` int32 array: ``page_id * page_size + position % page_size``.)");

  bind_kv(m);
  bind_attention(m);
  bind_decode(m);
  bind_matmul(m);
  bind_paged_attention(m);
  bind_diagnostics(m);
  bind_fused(m);
}
