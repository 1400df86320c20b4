// Index math over paged K/V storage (pages, kv_heads, page_size, head_dim).
#include "mlx_infer/kv.h"
#include "mlx_infer/text.h"

#include <stdexcept>
#include <string>

namespace mlx_infer {

namespace {

void check_storage(const mx::array& storage, const char* fn) {
  if (storage.ndim() != 4) {
    throw std::invalid_argument(std::string("[") + fn + "] storage must be (pages, kv_heads, page_size, " +
                                "head_dim); got shape " + shape_text(storage.shape()) + ".");
  }
}

void check_indices(const mx::array& a, const char* fn, const char* name) {
  if (a.ndim() != 1 || !mx::issubdtype(a.dtype(), mx::integer)) {
    throw std::invalid_argument(std::string("[") + fn + "] " + name + " must be a 1-D integer array; got " +
                                dtype_text(a.dtype()) + " of shape " + shape_text(a.shape()) + ".");
  }
}

}  // namespace

// gather_pages, page_size 4, length 6, block_table [7, 2, ...]:
//
//   take pages 7, 2   -> (2, H, 4, D)
//   swap page/head    -> (H, 2, 4, D)
//   merge page axes   -> (H, 8, D)     flat token axis of the sequence
//   keep first 6      -> (H, 6, D)
mx::array gather_pages(
    const mx::array& storage,
    const mx::array& block_table,
    int length,
    mx::StreamOrDevice s) {
  check_storage(storage, "gather_pages");
  check_indices(block_table, "gather_pages", "block_table");
  const int page_size = storage.shape(2);
  if (length < 0) {
    throw std::invalid_argument(
        "[gather_pages] length must be >= 0, got " + std::to_string(length) + ".");
  }
  const int n_pages = (length + page_size - 1) / page_size;
  if (n_pages > block_table.shape(0)) {
    throw std::invalid_argument(
        "[gather_pages] length " + std::to_string(length) + " needs " +
        std::to_string(n_pages) + " pages of " + std::to_string(page_size) +
        " tokens but block_table has " + std::to_string(block_table.shape(0)) + ".");
  }
  const int heads = storage.shape(1);
  const int head_dim = storage.shape(3);
  auto table = mx::slice(mx::astype(block_table, mx::int32, s), {0}, {n_pages}, s);
  auto pages = mx::take(storage, table, 0, s);                 // (n, H, P, D)
  pages = mx::transpose(pages, {1, 0, 2, 3}, s);               // (H, n, P, D)
  auto flat = mx::reshape(pages, {heads, n_pages * page_size, head_dim}, s);
  return mx::slice(flat, {0, 0, 0}, {heads, length, head_dim}, s);  // (H, L, D)
}

mx::array scatter_slots(
    const mx::array& storage,
    const mx::array& slots,
    const mx::array& values,
    mx::StreamOrDevice s) {
  check_storage(storage, "scatter_slots");
  check_indices(slots, "scatter_slots", "slots");
  const int heads = storage.shape(1);
  const int page_size = storage.shape(2);
  const int head_dim = storage.shape(3);
  const int n = slots.shape(0);
  if (values.ndim() != 3 || values.shape(0) != heads || values.shape(1) != n ||
      values.shape(2) != head_dim) {
    throw std::invalid_argument("[scatter_slots] values must be (kv_heads, T, head_dim) = (" + std::to_string(heads) +
                                ", " + std::to_string(n) + ", " + std::to_string(head_dim) + ") to match storage " +
                                shape_text(storage.shape()) + " and " + std::to_string(n) + " slots; got " +
                                shape_text(values.shape()) + ".");
  }
  if (n == 0) {
    return storage;
  }
  auto flat = mx::astype(slots, mx::int32, s);
  auto ps = mx::array(page_size, mx::int32);
  auto page = mx::floor_divide(flat, ps, s);                   // (T,)
  auto offset = mx::remainder(flat, ps, s);                    // (T,)
  // scatter wants updates shaped indices + storage with indexed axes as 1.
  auto upd = mx::transpose(mx::astype(values, storage.dtype(), s), {1, 0, 2}, s);
  upd = mx::reshape(upd, {n, 1, heads, 1, head_dim}, s);       // (T, 1, H, 1, D)
  return mx::scatter(storage, {page, offset}, upd, {0, 2}, s);
}

}  // namespace mlx_infer
