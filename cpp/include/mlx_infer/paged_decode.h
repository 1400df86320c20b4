// The compiled one-token decode step over paged KV (DESIGN.md, "Contracts":
// DecodeStep; issue 5). The same layer code as DecodeStep (cpp/decode/graph.cpp),
// reading and writing the pages of a paged store instead of owning buffers.
//
// The step owns no KV. Each call gets the store's page arrays, one K and one V
// per KV-owning layer (every layer but gemma4's KV-shared ones, which attend
// over their donor's gather; "layer" below means KV-owning layer), and returns
// their updated versions:
//
//   storage  (pages, kv_heads, page_size, head_dim)   per layer, K and V (gemma4:
//            each layer's own kv_heads and head_dim)
//            page 0 is the null page: padding reads it, nothing writes it
//
//   per layer group g (layers sharing one gather: one window, one page table)
//     pages, offsets  (B, S) int32   token s of row b sits at (pages, offsets)[b, s]
//     mask            (B, S) bool    which of them row b attends to
//     write_pages,
//     write_offsets   (B,)   int32   where row b's new token goes
//
//   row b's new token is at position positions[b] (RoPE) and is part of what
//   it reads (the gather includes the slot it is written to).
//
// Per layer: scatter the B new K/V rows into the storage (MLX updates the
// buffer in place once the caller drops its reference), gather (B, KVH, S, D)
// from the updated storage, attend under the mask, rest of the layer as
// decode_forward.
//
// Compiled (PagedDecodeConfig::compile): the whole step is one mx::compile'd
// function of its array inputs, so per-step integers never retrace it; only
// shapes do (B, each group's S, the page count). S grows a token per step, so
// it is rounded up to a multiple of s_bucket (padding points at the null page,
// masked out): a steady-state step between bucket boundaries does not trace.
// Otherwise the graph is built op by op every step at the exact S.
//
// Transactional: the step only builds new arrays; the caller replaces its
// storage with the returned arrays (its commit). A step that throws leaves the
// caller's storage as it was.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "mlx_infer/decode.h"

namespace mlx_infer {

/// Shape-independent choices of a PagedDecodeStep.
struct PagedDecodeConfig {
  /// Per KV-owning layer: index of its layer group (the gather it reads). Groups are 0..G-1.
  std::vector<int> layer_groups;
  /// mx::compile the step (else build op by op each step).
  bool compile = true;
  /// Compiled: round each group's S up to a multiple of this (>= 1).
  int s_bucket = 32;
};

/// One layer group's per-step inputs (see the file comment).
struct PagedGroupInputs {
  mx::array pages;          // (B, S) int32
  mx::array offsets;        // (B, S) int32
  mx::array mask;           // (B, S) bool
  mx::array write_pages;    // (B,) int32
  mx::array write_offsets;  // (B,) int32
};

/// Logits and each layer's updated storage.
struct PagedStepOutput {
  mx::array logits;               // (B, vocab), lazy
  std::vector<mx::array> keys;    // per layer, the storage's shape
  std::vector<mx::array> values;  // per layer
};

/// A one-token decode step over paged K/V it does not own. Not thread-safe.
class PagedDecodeStep {
 public:
  /// Args: as DecodeStep's (``config.kv_dtype``, capacity and compile fields
  /// are not used; the storage's dtype is the KV dtype), plus ``paged``.
  PagedDecodeStep(
      DecodeConfig config,
      PagedDecodeConfig paged,
      const std::unordered_map<std::string, mx::array>& weights,
      const std::unordered_map<std::string, QuantSpec>& quantization);
  ~PagedDecodeStep();

  /// One token per row. Raises std::invalid_argument on inputs of the wrong
  /// count, shape or dtype (nothing is built then).
  ///
  /// Args:
  ///   tokens: (B,) integer ids.
  ///   positions: (B,) integer positions of the new tokens.
  ///   groups: one PagedGroupInputs per layer group.
  ///   keys, values: per layer, the storage (pages, kv_heads, page_size, head_dim),
  ///     float16 / bfloat16 / float32 (quantized storage is refused).
  PagedStepOutput step(
      const mx::array& tokens,
      const mx::array& positions,
      const std::vector<PagedGroupInputs>& groups,
      const std::vector<mx::array>& keys,
      const std::vector<mx::array>& values);

  /// Times the compiled step was traced (one per input-shape signature seen).
  int traces() const;
  /// Traces of a shape signature traced before (MLX's compile cache missed): 0 when healthy.
  int retraces() const { return retraces_; }
  /// Distinct input-shape signatures the compiled step has run with.
  int signatures() const { return static_cast<int>(seen_.size()); }
  int steps() const { return steps_; }
  int num_groups() const { return num_groups_; }
  const DecodeConfig& config() const;
  const PagedDecodeConfig& paged_config() const { return paged_; }

 private:
  std::shared_ptr<DecodeStep::Graph> graph_;
  PagedDecodeConfig paged_;
  int num_groups_ = 0;
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> compiled_;
  std::set<std::vector<int>> seen_;
  int retraces_ = 0;
  int steps_ = 0;
};

}  // namespace mlx_infer
