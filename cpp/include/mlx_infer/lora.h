// LoRA / DoRA adapters as inputs of the compiled decode steps (issue 21).
//
// The steps take the adapter bank's stacked tensors and a per-row slot vector as
// extra inputs, so the traced graph depends on their shapes only: adapters loaded,
// swapped or unloaded between steps change values, not the trace. Per targeted
// linear (by canonical name, ``layers.3.q``):
//
//   a       (S, in, r)    stacked A of the S bank slots (slot 0 = no adapter: zeros)
//   b       (S, r, out)   stacked B
//     or, a small bank, a (S r, in) and b (out, S r) as linear weights: the slots
//     concatenated, b already multiplied by each slot's scale (the dense product below,
//     on the CPU kernels when the layer runs on them)
//   scales  (S,) float32
//   g       (S, out)      optional: DoRA's m / ||W + scale (a b)^T|| (1 for non-DoRA slots)
//
// and per step ``slots`` (B,) int32, the slot of each row. The update, per row, with
// the same ops as python/mlx_infer/adapters/apply.py's per-row path:
//
//   gathered: xa = gather_mm(x, a, rhs=slots); z = gather_mm(xa, b, rhs=slots)
//             y  = base(x) + (scales[slots] * z).astype(x.dtype)
//   dense:    xa = (x @ a^T) * mask, mask[b, c] = (c / r == slots[b]);  y = base(x) + (xa @ b^T).astype(x.dtype)
//   DoRA: y = g[slots] * (x W^T + delta) + bias
//
// A fused q|k|v or gate|up (one product over concatenated weights) is targeted by its own
// name (``layers.3.qkv``: one update over its rows; the bindings give untargeted members zero
// rows of b), or by its members' names: the fused product then gets each member's delta added
// to the member's rows (zeros for members no adapter targets), the same ops per member as its
// own linear. Not both.
//
// Where the layer runs on the CPU kernels the dense form is one op per linear instead
// (mlx_infer/matmul.h's fast_lora_linear / fast_lora_quantized_matmul, fast_lora_update for
// DoRA's bias-free base): the product, each row's own slot's r columns of a and b, the add.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <mlx/mlx.h>

namespace mlx_infer {

namespace mx = mlx::core;

/// The resident adapters given to a step.
struct LoraInputs {
  std::vector<std::string> targets;          // canonical linear names
  std::vector<mx::array> a;                  // per target (S, in, r)
  std::vector<mx::array> b;                  // per target (S, r, out)
  std::vector<mx::array> scales;             // per target (S,)
  std::vector<std::optional<mx::array>> g;   // per target (S, out) or none

  bool empty() const { return targets.empty(); }
};

}  // namespace mlx_infer
