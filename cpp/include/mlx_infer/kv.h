// Paged KV cache: free functions over mx::array (see DESIGN.md, convention 5).
#pragma once

#include <mlx/mlx.h>

namespace mlx_infer {

namespace mx = mlx::core;

/// Flat write slots for tokens at `positions` of sequences whose pages are
/// listed in `block_tables`.
///
///   block_tables (B, max_pages) int32: page ids, row b for sequence b
///   positions    (B, L)         int32: token positions within each sequence
///   returns      (B, L)         int32: page_id * page_size + position % page_size
///
/// A position past the end of its block table is a caller bug and raises.
mx::array slot_mapping(
    const mx::array& block_tables,
    const mx::array& positions,
    int page_size,
    mx::StreamOrDevice s = {});

}  // namespace mlx_infer
