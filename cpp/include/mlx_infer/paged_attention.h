// Attention of one query token per row over paged K/V, read through block
// tables (issue 16): no gathered (R, KVH, S, D) copy of the keys.
//
//   q             (R, H, D)                 one query token per row
//   k_storage,
//   v_storage     (pages, KVH, P, D)        a layer's page storage (page 0: the null page)
//   block_tables  (R, T) int32              row r's logical page j -> storage page
//   lengths       (R,)   int32              row r attends to the keys at positions
//                                           [max(0, length - window), length)
//   -> out        (R, H, D), q's dtype
//
// GQA: query head h reads KV head h / (H / KVH). window <= 0: no window.
// Table entries a row reads (logical pages below ceil(length / P)) must be
// valid page ids: the CPU kernel clamps them for memory safety only, the CUDA
// kernel does not check them. Keys past T * P are never read (a length beyond
// it attends to the first T * P keys only).
// Scores and the softmax accumulate in float32 (online softmax). A row with
// length <= 0 attends to nothing and gets zeros. softcap > 0 caps each score
// s = scale * q.k as softcap * tanh(s / softcap) before the softmax (Gemma 2);
// 0 = no cap (the kernels compile the cap away). sinks (H,), when given: head
// h's sink logit joins its softmax as one more score with no value (gpt-oss:
// the weights of the keys sum to less than 1); the kernels read it as float32.
//
// Implementations (paged_attention_backend):
//   "cpu"    an mx::Primitive (eval_cpu) on mlx-infer's thread pool, tasks over rows x KV heads
//   "cuda"   an NVRTC kernel through mx::fast::cuda_kernel; split-K (flash decoding) when
//            rows x KV heads are too few blocks to fill the GPU, partials merged by a second kernel
//   "gather" the reference (Metal, and any dtype the kernels do not take): gather then MLX SDPA
#pragma once

#include <mlx/mlx.h>

#include <optional>
#include <string>
#include <utility>

namespace mlx_infer {

namespace mx = mlx::core;

/// Paged attention through the block tables (see the file comment): (R, H, D), or (R, H D) with
/// ``flat_heads`` (what the next product reads; on CUDA the kernel writes it so, with no view after it).
/// ``split_counts``: int32, at least R x KVH elements, all zero, and not read or written by anything else
/// on another stream meanwhile: with it a CUDA split-K launch merges its splits inside the one kernel (the
/// last split of each (row, KV head) merges, then sets its count back to zero: the array is zero again
/// after the kernel, ready for the next). The paged step keeps one per step object. Elsewhere ignored.
/// Raises std::invalid_argument on shapes or dtypes that do not fit.
mx::array paged_attention(const mx::array& q, const mx::array& k_storage, const mx::array& v_storage,
                          const mx::array& block_tables, const mx::array& lengths, int window, float scale,
                          float softcap = 0.0f, const std::optional<mx::array>& sinks = std::nullopt,
                          mx::StreamOrDevice s = {}, bool flat_heads = false,
                          const std::optional<mx::array>& split_counts = std::nullopt);

/// The same contract computed by gathering (R, KVH, S, D) and MLX SDPA (soft-capped: the composed
/// softcapped_attention, mlx_infer/softcap_attention.h): the reference.
mx::array paged_attention_gather(const mx::array& q, const mx::array& k_storage, const mx::array& v_storage,
                                 const mx::array& block_tables, const mx::array& lengths, int window,
                                 float scale, float softcap = 0.0f,
                                 const std::optional<mx::array>& sinks = std::nullopt, mx::StreamOrDevice s = {});

/// "cpu", "cuda" or "gather": what paged_attention runs for these inputs on stream ``s``.
std::string paged_attention_backend(const mx::array& q, const mx::array& k_storage,
                                    mx::StreamOrDevice s = {});

/// The same for a q of ``heads`` x ``head_dim`` in ``q_dtype``, before q exists (a kernel that makes q may
/// write the storage only where the attention that follows reads it through the kernel).
std::string paged_attention_backend(int heads, int head_dim, mx::Dtype q_dtype, const mx::array& k_storage,
                                    mx::StreamOrDevice s = {});

/// Gather indices of the reference path, built on the device from tables and lengths:
/// rows (R, KVH, S) int32 into the storage viewed as (pages * KVH * P, D), and the
/// visibility mask (R, 1, 1, S) bool. S = T * P, or the window when it is smaller.
/// Padding points at slot 0 of the null page, masked out.
std::pair<mx::array, mx::array> paged_gather_index(const mx::array& block_tables, const mx::array& lengths,
                                                   int window, int kv_heads, int page_size);

/// The CUDA kernels' split count for R rows x KVH heads over at most ``max_keys`` keys
/// (1: no split). Exposed for tests and benchmarks.
int paged_attention_splits(int rows, int kv_heads, int max_keys);

}  // namespace mlx_infer
