#include "mlx_infer/kv.h"

#include <stdexcept>
#include <string>

namespace mlx_infer {

mx::array slot_mapping(
    const mx::array& block_tables,
    const mx::array& positions,
    int page_size,
    mx::StreamOrDevice s) {
  if (page_size <= 0) {
    throw std::invalid_argument(
        "[slot_mapping] page_size must be positive, got " +
        std::to_string(page_size) + ".");
  }
  if (block_tables.ndim() != 2 || positions.ndim() != 2) {
    throw std::invalid_argument(
        "[slot_mapping] block_tables must be (B, max_pages) and positions "
        "(B, L); got " + std::to_string(block_tables.ndim()) + "-D and " +
        std::to_string(positions.ndim()) + "-D arrays.");
  }
  if (block_tables.shape(0) != positions.shape(0)) {
    throw std::invalid_argument(
        "[slot_mapping] block_tables and positions disagree on the batch "
        "size: " + std::to_string(block_tables.shape(0)) + " vs " +
        std::to_string(positions.shape(0)) + ".");
  }
  auto pos = mx::astype(positions, mx::int32, s);
  auto page_index = mx::floor_divide(pos, mx::array(page_size, mx::int32), s);
  auto pages = mx::take_along_axis(
      mx::astype(block_tables, mx::int32, s), page_index, 1, s);
  auto offset = mx::remainder(pos, mx::array(page_size, mx::int32), s);
  return mx::add(mx::multiply(pages, mx::array(page_size, mx::int32), s),
                 offset, s);
}

}  // namespace mlx_infer
