// The compiled paged step (DESIGN.md, "Contracts": DecodeStep; issue 5, issue
// 16). The same forward as DecodeStep (cpp/decode/forward.cpp), reading and
// writing the pages of a paged store where DecodeStep reads and writes the plain caches' buffers.
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
// R rows, each one query token: a decode row, or one token of a prefill chunk
// (a chunk of L tokens is L rows with the same block table contents and
// consecutive positions). Step-wide:
//
//   tokens      (R,)  integer ids
//   positions   (R,)  int32, RoPE position of each row's token
//   logit_rows  (M,)  int32, the rows that get logits (the head runs on those
//                     only); logits come back (M, vocab) in that order
//
// Per layer group g (layers sharing one window and one page table; the order
// of DecodeBatch.windows_of):
//
//   block_tables (R, T) int32  row r's pages in its group's storage, logical
//                              page j holds positions [j P, (j + 1) P); padded
//                              with 0 (the null page)
//   lengths      (R,)   int32  = position + 1: row r attends to the keys at
//                              positions [max(0, length - window), length),
//                              its own new key included
//   write_slots  (R,)   int32  page * page_size + offset of row r's new K/V
//
// Per layer: all R new K/V rows are scattered into the storage first (MLX
// updates the buffer in place once the caller drops its reference), then
// attention reads through the tables, so the tokens of a prefill chunk see
// each other causally through their lengths. Attention (PagedDecodeConfig::
// attention):
//
//   kernel   paged_attention (mlx_infer/paged_attention.h): reads K/V through
//            the tables, no gathered copy. CPU and CUDA; on Metal (no kernel
//            yet: none could be run and tested here) it falls back to gather.
//   gather   the reference and fallback: the (R, KVH, S, D) copy is gathered
//            from the updated storage with indices built on the device from
//            tables and lengths (S = T P, or the window when smaller), then
//            MLX SDPA under a (R, 1, 1, S) mask. Multi-head latent attention
//            (deepseek_v3: K the latent, V the RoPE key, widths of their own)
//            takes this path on every backend, whatever ``attention`` says.
//
// Compiled (PagedDecodeConfig::compile): the whole step is one mx::compile'd
// function of its array inputs, so per-step integers never retrace it; only
// shapes do (R and M, padded to buckets unless pad_rows is off, each group's
// T, the page count). T grows a page every
// page_size tokens, so it is rounded up to a multiple of t_bucket (padding is
// the null page, never read: lengths bound every read): a steady-state step
// between bucket boundaries does not trace. Otherwise the graph is built op by
// op every step at the exact T.
//
// Transactional: the step only builds new arrays; the caller replaces its
// storage with the returned arrays (its commit). A step that throws leaves the
// caller's storage as it was. Evaluated, the step writes the new K/V rows into
// the storage's buffers in place (MLX donates them to the Scatter; on CUDA
// qkv_rope writes them itself and returns the storage arrays as they came):
// only the new rows' slots change.
#pragma once

#include <memory>
#include <optional>
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
  /// Compiled: round each group's block-table width T (pages) up to a multiple of this (>= 1).
  int t_bucket = 4;
  /// Compiled: run R rows (and M logit rows) padded up to a bucket (powers of two to 16, then
  /// multiples of 16), so a batch that changes by a row rarely retraces. Padding rows are token
  /// 0 at position 0 writing and reading slot 0 of the null page (read elsewhere only masked).
  bool pad_rows = true;
  /// "kernel" (paged_attention, no gathered copy; gather on Metal) or "gather" (the reference).
  std::string attention = "kernel";
};

/// One layer group's per-step inputs (see the file comment).
struct PagedGroupInputs {
  mx::array block_tables;  // (R, T) int32
  mx::array lengths;       // (R,) int32
  mx::array write_slots;   // (R,) int32
};

/// Logits and each layer's updated storage.
struct PagedStepOutput {
  mx::array logits;               // (M, vocab), lazy
  std::vector<mx::array> keys;    // per layer, the storage's shape
  std::vector<mx::array> values;  // per layer
};

/// A step of one query token per row over paged K/V it does not own. Not thread-safe.
class PagedDecodeStep {
 public:
  /// Args: as DecodeStep's (``config.kv_dtype``, ``max_capacity`` and compile fields
  /// are not used; the storage's dtype is the KV dtype), plus ``paged``.
  PagedDecodeStep(
      DecodeConfig config,
      PagedDecodeConfig paged,
      const std::unordered_map<std::string, mx::array>& weights,
      const std::unordered_map<std::string, QuantSpec>& quantization);
  ~PagedDecodeStep();

  /// One query token per row. Raises std::invalid_argument on inputs of the
  /// wrong count, shape or dtype (nothing is built then).
  ///
  /// Args:
  ///   tokens: (R,) integer ids.
  ///   positions: (R,) integer positions of the new tokens.
  ///   logit_rows: (M,) integer rows whose logits are returned.
  ///   groups: one PagedGroupInputs per layer group.
  ///   keys, values: per layer, the storage (pages, kv_heads, page_size, head_dim),
  ///     float16 / bfloat16 / float32 (quantized storage is refused).
  ///   call_ends: (R,) integer end of each row's call (StepPlan::call_ends: a prefill chunk's rows
  ///     share start + n), which picks a LongRoPE layer's table; none: positions + 1.
  PagedStepOutput step(
      const mx::array& tokens,
      const mx::array& positions,
      const mx::array& logit_rows,
      const std::vector<PagedGroupInputs>& groups,
      const std::vector<mx::array>& keys,
      const std::vector<mx::array>& values,
      const std::optional<mx::array>& adapter_slots = std::nullopt,
      const std::optional<mx::array>& call_ends = std::nullopt);

  /// The adapter bank's stacked tensors as inputs of every later step (see DecodeStep::set_adapters);
  /// ``adapter_slots`` (R,) of step() then picks each row's bank slot (none: no row has an
  /// adapter, and the step runs without the update).
  void set_adapters(const LoraInputs& adapters);

  /// Times the compiled step was traced (one per input-shape signature seen).
  int traces() const;
  /// Traces of a shape signature traced before (MLX's compile cache missed): 0 when healthy.
  int retraces() const { return retraces_; }
  /// Distinct input-shape signatures the compiled step has run with.
  int signatures() const { return static_cast<int>(seen_.size()); }
  int steps() const { return steps_; }
  /// What the last built (or traced) step's attention ran on: "cpu", "cuda" or "gather"
  /// ("" before the first step). A compiled step replaying a trace keeps the trace's value.
  const std::string& attention_backend() const { return *backend_; }
  int num_groups() const { return num_groups_; }
  const DecodeConfig& config() const;
  const PagedDecodeConfig& paged_config() const { return paged_; }

 private:
  std::shared_ptr<DecodeStep::Graph> graph_;
  std::shared_ptr<std::string> backend_ = std::make_shared<std::string>();
  PagedDecodeConfig paged_;
  int num_groups_ = 0;
  bool call_ends_ = false;  // some layer is LongRoPE: the step reads each row's call end
  int max_kv_heads_ = 1;    // the most KV heads of a layer: split counters per row
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> compiled_;
  std::shared_ptr<const LoraLayout> lora_;
  std::vector<mx::array> lora_arrays_;
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> compiled_lora_;  // with lora_
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> compile_forward(
      std::shared_ptr<const LoraLayout> lora) const;
  void compile_step();
  std::set<std::vector<int>> seen_;
  int retraces_ = 0;
  int steps_ = 0;
  // The CUDA attention kernel's split counters (paged_attention's split_counts): int32 zeros, at least rows x
  // KV heads, grown by powers of two (a new size retraces once); the kernels leave them zero.
  std::optional<mx::array> split_counts_;
};

}  // namespace mlx_infer
