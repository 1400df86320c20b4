// Internal to cpp/: a fused q|k|v product's output as contiguous q, k, v with RoPE on q and k, in one CUDA
// kernel (qkv_rope_cuda.cpp). The CPU and Metal graphs keep MLX's slices and mx::fast::rope.
#pragma once

#include <mlx/mlx.h>

#include <array>

#include "mlx_infer/decode.h"

namespace mlx_infer {

namespace mx = mlx::core;

/// The per-head q and k RMSNorms before RoPE (gemma3, qwen3): weights (D,) of qkv's dtype, their epsilon.
struct QkNorm {
  mx::array q_w, k_w;
  float eps;
};

/// Whether the graphs hand per-head q/k norms to qkv_rope (QkNorm): default on, MLX_INFER_QKV_ROPE_NORM=0 off
/// (MLX's RMSNorm, RoPE and the K/V Scatters, as before); read at each call (a graph's trace).
bool qkv_rope_norm_enabled();

/// Whether qkv_rope takes these: the CUDA backend, ``qkv`` (R, (H + 2 KVH) D) of a float dtype, an even
/// head_dim and rotated dims, RoPE by base or freqs without a YaRN magnitude correction or LongRoPE's
/// second (long) table; with ``norm``, its weights (D,) of qkv's dtype and D <= 2048.
bool qkv_rope_supported(const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope,
                        const QkNorm* norm = nullptr);

/// Whether the paged step uses qkv_rope where supported: MLX_INFER_QKV_ROPE=0 turns it off (MLX's split and
/// RoPE, as before), read once.
bool qkv_rope_enabled();

/// q (R, H, D), k (R, KVH, D), v (R, KVH, D), each contiguous, from ``qkv`` (R, (H + 2 KVH) D): q and k
/// rotated at ``positions`` (R,) as ``mx::fast::rope`` rotates them. With ``kv_write_rows`` k and v come
/// shaped (R KVH, 1, 1, 1, D), the same memory in the layout the paged step's K/V Scatter takes as its
/// updates, so no view sits between this kernel and the write (each graph node costs MLX's host time every
/// step). With ``norm`` each q and k head is first RMS-normed as ``mx::fast::rms_norm(head, w, eps)`` computes
/// it (float32 sum of squares, w * dtype(x * rsqrt(mean + eps)), rounded to the dtype before the rotation; the
/// squares add in another order, so a value can differ in its last bit). Call only where qkv_rope_supported.
std::array<mx::array, 3> qkv_rope(const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope,
                                  const mx::array& positions, bool kv_write_rows = false,
                                  const QkNorm* norm = nullptr);

/// Whether the paged step lets qkv_rope write K and V straight into the storage (qkv_rope_write) where it
/// can: MLX_INFER_QKV_ROPE_WRITE=0 turns it off (two Scatters a layer, as before), read at each trace.
bool qkv_rope_write_enabled();

/// Whether qkv_rope_write takes this storage: enabled, (pages, KVH, P, D) K and V of ``qkv``'s dtype (the
/// Scatter's path converts), ``slots`` (R,) int32. Call with qkv_rope_supported's inputs.
bool qkv_rope_write_supported(const mx::array& qkv, int KVH, int D, const mx::array& k_storage,
                              const mx::array& v_storage, const mx::array& slots);

/// qkv_rope's q (R, H, D), its k and v written into ``k_storage`` / ``v_storage`` (pages, KVH, P, D) at each
/// row's slot (R,) (page slot / P, offset slot % P) in place, in the same launch: the two K/V Scatters of a
/// layer (and their index arrays) are no graph nodes. MLX's kernels take inputs const, so MLX does not see
/// the write: the storage must be contiguous (the paged step's always are), each slot a row's own (the step
/// plan's copy-on-write), and whatever reads the written rows must depend on the returned q (the paged
/// attention that takes q and the storage): then no kernel reads a slot before this one writes it. The
/// storage array is unchanged as a value in MLX's graph, so the step returns it as its updated storage.
/// ``norm``: as qkv_rope's (k normed before it is written).
mx::array qkv_rope_write(const mx::array& qkv, int H, int KVH, int D, const RopeSpec& rope,
                         const mx::array& positions, const mx::array& k_storage, const mx::array& v_storage,
                         const mx::array& slots, const QkNorm* norm = nullptr);

}  // namespace mlx_infer
