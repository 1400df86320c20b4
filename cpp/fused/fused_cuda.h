// Internal to cpp/: two fused elementwise kernels of the decode graphs on CUDA (mx::fast::cuda_kernel, NVRTC at
// run time), each replacing two or three graph nodes of every layer: launches and passes over the activations
// fewer. On by default: a CustomKernel node costs MLX's host more than a built-in op (~6-7 against ~3 us;
// benchmarks/RESULTS.md "Session 21"), but the nodes they save won on an H100 at every point measured, host-bound
// and device-bound steps alike (sessions 27, 28). The CPU and Metal graphs keep MLX's ops.
//   - add_rms_norm (residual_norm_cuda.cpp): h + r and RMSNorm of that sum, one launch (MLX: Add, RMSNorm; with
//     a sandwich norm RMSNorm, Add, RMSNorm).
//   - gated_activation (gated_cuda.cpp): act(gate) * up straight from a fused gate|up product's output
//     (MLX: Split, then the compiled activation).
#pragma once

#include <mlx/mlx.h>

#include <string>
#include <utility>

namespace mlx_infer {

namespace mx = mlx::core;

/// Whether the decode graphs fuse the residual add and the next norm (add_rms_norm where it applies):
/// default on, MLX_INFER_FUSED_ADD_NORM=0 off; read at each call (a graph's trace), so one process can compare
/// both (benchmarks/RESULTS.md, session 27: faster at 1, 8 and 32 streams on an H100).
bool fused_add_norm_enabled();

/// Whether the decode graphs take gated_activation where it applies: default on, MLX_INFER_FUSED_GATED=0 off,
/// read as above.
bool fused_gated_enabled();

/// Whether add_rms_norm takes these (the switch above aside): the CUDA backend with the GPU as the default
/// device, h and r (R, E) of one float dtype, w (E,) of that dtype, rows of a multiple of 16 bytes and at most
/// 64 Ki elements.
/// ``pre_w``: a sandwich norm's weight (E,) of that dtype, as add_rms_norm takes it.
bool add_rms_norm_applies(const mx::array& h, const mx::array& r, const mx::array& w,
                          const mx::array* pre_w = nullptr);

/// (h + r, rms_norm(h + r, w, eps)) for h, r (R, E): the sum rounded to the dtype as mx::add rounds it, the
/// norm as mx::fast::rms_norm computes it (float32 sum of squares, rsqrt(mean + eps), w * dtype(x * inv)); the
/// sum of squares adds in another order than MLX's kernel, so the norm can differ in its last bit. With
/// ``pre_w`` (a sandwich norm, gemma) r is first rms_norm(r, pre_w, eps) the same way, and with ``clip_f16``
/// a float16 sum is taken in float32 and clipped to float16's range (gemma3's residual). Call only where
/// add_rms_norm_applies.
std::pair<mx::array, mx::array> add_rms_norm(const mx::array& h, const mx::array& r, const mx::array& w, float eps,
                                             const mx::array* pre_w = nullptr, bool clip_f16 = false);

/// The most rows (tokens) of a step whose graph takes the norm-carrying kernels (add_rms_norm, qkv_rope's q/k
/// norms): default 256 (every decode-only step: the engine's most rows on a GPU), MLX_INFER_FUSED_NORM_MAX_ROWS
/// to change it (0: never), read at each call (a trace). Why a bound: MLX's CUDA backend keeps every input of a
/// node alive until the CUDA graph holding it has run (mlx/backend/cuda/eval.cpp: add_temporary; MLX's own ops
/// donate one of theirs, a CustomKernel none) and commits a graph every 100 nodes, so a layer of fewer nodes puts
/// more layers' activations in each graph: with both kernels gemma3-270m's 2,048-row prompt-chunk steps held
/// ~0.4 GB more than with MLX's ops, and the engine's peak rose above mlx-lm's (H100, benchmarks/RESULTS.md
/// "Session 29"). A decode step's rows hold little and gain most from the fewer launches.
int fused_norm_max_rows();

/// Whether gated_activation takes these (the switch above aside): the CUDA backend with the GPU as the default
/// device, ``gate_up`` (R, 2F) of one float dtype with F a multiple of 16 bytes, ``activation`` "silu" or
/// "gelu_tanh".
bool gated_activation_applies(const mx::array& gate_up, const std::string& activation);

/// act(gate) * up for ``gate_up`` (R, 2F) = [gate | up] -> (R, F): "silu" as swiglu (gate * sigmoid(gate) * up),
/// "gelu_tanh" as geglu (the tanh approximation of GELU), each operation rounded to the dtype in the order
/// MLX's compiled graph rounds it (decode/graph.cpp: swiglu_ops, geglu_ops). Call only where
/// gated_activation_applies.
mx::array gated_activation(const mx::array& gate_up, const std::string& activation);

}  // namespace mlx_infer
