// softcapped_attention: the composed (unfused) attention of Gemma 2 (see mlx_infer/softcap_attention.h).
#include "mlx_infer/softcap_attention.h"

#include <stdexcept>

namespace mlx_infer {

mx::array softcapped_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                               float softcap, const std::optional<mx::array>& mask,
                               const std::optional<mx::array>& sinks, mx::StreamOrDevice s) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || k.shape(1) < 1 || q.shape(1) % k.shape(1) != 0) {
    throw std::invalid_argument(
        "[softcapped_attention] takes q (B, H, L, D), k and v (B, KVH, S, D) with H a multiple of KVH.");
  }
  if (!(softcap >= 0.0f)) {
    throw std::invalid_argument("[softcapped_attention] softcap must be >= 0 (0 = none).");
  }
  const int B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int KVH = k.shape(1), repeats = H / KVH;
  const auto dt = q.dtype();
  auto queries = mx::multiply(q, mx::array(scale, dt), s);
  auto keys = k, values = v;
  if (repeats > 1) {
    queries = mx::reshape(queries, {B, KVH, repeats, L, D}, s);  // (B, KVH, rep, L, D)
    keys = mx::expand_dims(keys, 2, s);                          // (B, KVH, 1, S, D)
    values = mx::expand_dims(values, 2, s);
  }
  auto scores = mx::matmul(queries, mx::swapaxes(keys, -1, -2, s), s);  // (B, KVH, rep, L, S) or (B, H, L, S)
  if (softcap > 0.0f) {
    const auto cap = mx::array(softcap, scores.dtype());
    scores = mx::multiply(mx::tanh(mx::divide(scores, cap, s), s), cap, s);
  }
  if (mask) {
    auto m = *mask;
    if (repeats > 1 && m.ndim() > 3) {
      m = mx::expand_dims(m, -3, s);  // (B, 1, 1, L, S)
    }
    if (m.dtype() == mx::bool_) {
      const auto lowest = mx::array(static_cast<float>(mx::finfo(scores.dtype()).min), scores.dtype());
      scores = mx::where(m, scores, lowest, s);
    } else {
      scores = mx::add(scores, m, s);
    }
  }
  if (sinks) {  // (H,) -> a first column of each head's scores, dropped after the softmax
    auto col = mx::astype(*sinks, scores.dtype(), s);
    col = repeats > 1 ? mx::reshape(col, {1, KVH, repeats, 1, 1}, s) : mx::reshape(col, {1, H, 1, 1}, s);
    auto shape = scores.shape();
    shape.back() = 1;
    scores = mx::concatenate({mx::broadcast_to(col, shape, s), scores}, -1, s);
  }
  scores = mx::softmax(scores, -1, /*precise=*/true, s);
  if (sinks) {
    auto start = mx::Shape(scores.ndim(), 0);
    start.back() = 1;
    scores = mx::slice(scores, start, scores.shape(), s);
  }
  auto out = mx::matmul(scores, values, s);
  if (repeats > 1) {
    out = mx::reshape(out, {B, H, L, -1}, s);  // (B, H, L, Dv)
  }
  return out;
}

}  // namespace mlx_infer
