// CPU matmul primitives: dense and MLX-affine-quantized `x @ W^T` for linear layers.
//
// MLX's Linux CPU backend runs these products through the reference BLAS (f32)
// or scalar loops (bf16/f16, quantized). These ops build our own primitive when
// the stream is on the CPU and MLX's op otherwise, so a model can call them
// unconditionally:
//
//   fast_linear(x, W)                   == x @ W.T           (W: (N, K) float)
//   fast_quantized_matmul(x, Wq, s, b)  == mx.quantized_matmul(x, Wq, s, b, transpose=True)
//
// Kernels compute in float32 (inputs converted on load, accumulation in
// float32, one rounding to the output dtype at the end); they are chosen at run
// time by the CPU's instruction set (AVX-512, AVX2+FMA, or portable C++) and
// run on a persistent pool of `cpu_threads()` threads (the MLX stream thread
// takes part, so MLX's own CPU work and ours never exceed that count).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <mlx/mlx.h>

namespace mlx_infer {

namespace mx = mlx::core;

/// `x @ weight.T (+ bias)` over the last axis of x.
///
/// Args:
///   x: (..., K) float32/bfloat16/float16.
///   weight: (N, K) float32/bfloat16/float16 (a Linear layer's weight).
///   bias: optional (N,).
/// Returns (..., N) in the promoted dtype of x and weight. On a non-CPU stream,
/// or for shapes/dtypes the kernels do not cover, MLX's own matmul/addmm.
mx::array fast_linear(
    const mx::array& x,
    const mx::array& weight,
    const std::optional<mx::array>& bias = std::nullopt,
    mx::StreamOrDevice s = {});

/// `mx::quantized_matmul(x, w, scales, biases, transpose, group_size, bits, mode)`.
///
/// Our kernel covers mode "affine" with biases, transpose=true, bits 4 or 8,
/// group_size 32/64/128 and float x/scales: MLX's packing (uint32 words,
/// 32/bits values per word, least significant first) and w ~ scale * q + bias
/// per group. Anything else, and every non-CPU stream, gets MLX's op.
mx::array fast_quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    bool transpose = true,
    int group_size = 64,
    int bits = 4,
    const std::string& mode = "affine",
    mx::StreamOrDevice s = {});

/// `act(gate) * up`, act "gelu_approx" (mlx.nn.gelu_approx, the tanh form) or
/// "silu": a gated MLP's activation in one pass, in float32 with vectorized
/// exp. gate and up share shape and dtype; otherwise, and on GPU streams, the
/// same formula in MLX ops.
mx::array fast_gated_activation(
    const mx::array& gate,
    const mx::array& up,
    const std::string& activation,
    mx::StreamOrDevice s = {});

/// One linear's per-row low-rank (LoRA) update added to its base output, in one call:
///
///   out[b, .., n] = base[b, .., n] + sum_{j in cols(s)} (x[b, ..] . a[j]) * b_w[row0 + n, j]
///   s = slots[b],  cols(s) = [col0 + s * rank, col0 + (s + 1) * rank)
///
/// a (rows, K) and b_w (N_all, rows) are linear weights (A^T and the scaled B^T of the
/// bank's slots, concatenated; a group of linears sharing x: A's stacked, B block-diagonal,
/// col0/row0 pick the member). Rows whose slot is 0 (no adapter) or >= slot_count are
/// base unchanged. On CPU streams (x and base one float dtype, a and b_w one float dtype)
/// our kernel: float32 accumulation, one rounding. Otherwise MLX ops of the same formula.
///
/// Args:
///   base: (B, .., N) the layer's output without the update.
///   x: (B, .., K) the layer's input.
///   slots: (B,) integers.
/// Returns (B, .., N) in the promoted dtype of base and x.
mx::array fast_lora_update(
    const mx::array& base,
    const mx::array& x,
    const mx::array& a,
    const mx::array& b,
    const mx::array& slots,
    int slot_count,
    int rank,
    int col0 = 0,
    int row0 = 0,
    mx::StreamOrDevice s = {});

/// `fast_lora_update(fast_linear(x, weight, bias), x, a, b, slots, ...)` as one op on CPU
/// streams: the product is written to the output and the update added in place.
mx::array fast_lora_linear(
    const mx::array& x,
    const mx::array& weight,
    const std::optional<mx::array>& bias,
    const mx::array& a,
    const mx::array& b,
    const mx::array& slots,
    int slot_count,
    int rank,
    int col0 = 0,
    int row0 = 0,
    mx::StreamOrDevice s = {});

/// `fast_lora_update(fast_quantized_matmul(x, w, scales, biases, true, group_size, bits), x, ...)`
/// as one op on CPU streams (mode "affine"; otherwise the two ops).
mx::array fast_lora_quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    const mx::array& a,
    const mx::array& b,
    const mx::array& slots,
    int slot_count,
    int rank,
    int col0 = 0,
    int row0 = 0,
    mx::StreamOrDevice s = {});

/// `x @ w.T` on CUDA through cuBLASLt with the fastest algorithm per shape (cpp/matmul/cublas_product.cpp).
///
/// x (..., K) and w (N, K), both bfloat16 or both float16, 2 to kTunedMaxRows rows (M = x.size / K) on a
/// GPU stream of MLX's CUDA backend: a TunedProduct primitive. The first product of each (M, N, K, dtype)
/// times up to 16 cuBLASLt heuristic candidates and their split-K variants and keeps the fastest
/// (MLX takes the first heuristic; MLX_INFER_TUNED_PRODUCTS_LOG=1 prints each choice to stderr).
/// Past kTunedMaxRows a product is compute-bound, where MLX's first pick does well, and an engine's
/// mixed steps (decode rows + prompt chunks) bring a new M at almost every step: tuning each would stall
/// the step it first appears in, so those stay MLX's.
/// With bias (N,) of x's dtype, `+ bias` in cuBLASLt's epilogue (as MLX's addmm on CUDA).
/// Everything else (the CPU, Metal, one row, other dtypes, a build without the CUDA toolkit) gets
/// `mx::matmul(x, mx::transpose(w))` (`mx::addmm(bias, ...)` with a bias), unchanged.
/// Throws std::invalid_argument when x's last axis is not w's K, or bias is not (N,).
/// The most rows tuned_linear tunes a product for (the compiled decode step's row buckets reach 256).
constexpr int64_t kTunedMaxRows = 256;

mx::array tuned_linear(
    const mx::array& x,
    const mx::array& w,
    const std::optional<mx::array>& bias = std::nullopt,
    mx::StreamOrDevice s = {});

/// True where tuned_linear builds its primitive: compiled with cuBLASLt (MLXI_CUBLAS) and MLX's CUDA
/// backend available.
bool tuned_products_available();

/// How skinny_linear's GEMV kernel runs a product. ``mma`` false, the CUDA-core form (1..16 rows of x):
/// ``rows_per_warp`` rows of w per warp (1..4), ``warps`` per block (1..16), ``unroll`` 16-byte chunks per
/// lane loaded at once (1..16). ``mma`` true, the tensor-core form (16-bit, K % 32 == 0, 1..64 rows):
/// ``rows_per_warp`` n-tiles of 8 rows of w per block (1..4), ``warps`` splitting K, ``unroll`` 32-element
/// steps in flight per lane.
struct GemvTiling {
  int rows_per_warp = 1;
  int warps = 4;
  int unroll = 8;
  bool mma = false;
};

/// The tiling skinny_linear uses for x of ``rows`` rows and w (n, k) of ``dtype`` when none is given.
GemvTiling default_gemv_tiling(int rows, int n, int k, mx::Dtype dtype);

/// The most rows of x a dense CUDA product of the decode graphs sends to skinny_linear: MLX_INFER_GEMV_ROWS
/// (0..64, 0: never), read at each call, else the default (8); a bad value is a std::invalid_argument naming it.
int gemv_max_rows();

/// The largest weight (MiB) a dense CUDA product of the decode graphs sends to skinny_linear:
/// MLX_INFER_GEMV_MAX_MIB (0: no cap), read at each call, else the default (64); a bad value throws as above.
long gemv_max_weight_mib();

/// The fewest rows of x a dense CUDA product of the decode graphs sends to skinny_linear: MLX_INFER_GEMV_MIN_ROWS
/// (1 or 2), read at each call, else 2 (one row stays on MLX's own GEMV); a bad value throws as above.
int gemv_min_rows();

/// The routing rule alone (any device): a product of ``rows`` rows of x over a weight of ``weight_bytes`` goes
/// to skinny_linear when gemv_min_rows() <= rows <= gemv_max_rows() and the weight is within
/// gemv_max_weight_mib(). gemv_cuda.cpp says why.
bool gemv_takes(int rows, std::int64_t weight_bytes);

/// Whether dense_linear takes skinny_linear for these operands: MLX's CUDA backend, a GPU stream, gemv_takes
/// for rows = x.size / K and w's bytes, x, w (N, K) and bias (N,) of one float dtype, K a multiple of 16 bytes
/// (above 16 rows: 16-bit with K a multiple of 32, the tensor-core form).
bool skinny_linear_applies(
    const mx::array& x,
    const mx::array& w,
    const std::optional<mx::array>& bias = std::nullopt,
    mx::StreamOrDevice s = {});

/// `x @ w.T (+ bias)` for x (..., K) of 1 to 64 rows by our CUDA GEMV kernel (cpp/matmul/gemv_cuda.cpp):
/// float32 accumulation, one rounding to the dtype; ``tiling`` default: default_gemv_tiling. CUDA streams
/// only (the kernel is NVRTC-compiled on the device). Throws std::invalid_argument naming the bad operand.
mx::array skinny_linear(
    const mx::array& x,
    const mx::array& w,
    const std::optional<mx::array>& bias = std::nullopt,
    std::optional<GemvTiling> tiling = std::nullopt,
    mx::StreamOrDevice s = {});

/// Whether the decode graphs prefetch each layer's o weight into the L2 after its q|k|v product on CUDA
/// (MLX_INFER_L2_PREFETCH_O=1; default off), read at each call (a graph's trace).
bool l2_prefetch_o_enabled();

/// Whether l2_prefetch takes these: MLX's CUDA backend with the GPU as the default device, x non-empty, w at
/// least one 128-byte line.
bool l2_prefetch_applies(const mx::array& x, const mx::array& w);

/// ``x`` unchanged (a copy), from one CUDA kernel that also asks the L2 for every line of ``w`` without waiting
/// for it (cpp/matmul/l2_prefetch_cuda.cpp), so a later product of ``w`` reads it from the L2. Throws
/// std::invalid_argument where l2_prefetch_applies is false.
mx::array l2_prefetch(const mx::array& x, const mx::array& w);

/// The decode graphs' dense `x @ w.T (+ bias)`: skinny_linear where skinny_linear_applies, else
/// `mx::matmul` (`mx::addmm` with a bias).
mx::array dense_linear(
    const mx::array& x,
    const mx::array& w,
    const std::optional<mx::array>& bias = std::nullopt,
    mx::StreamOrDevice s = {});

/// The most rows of x quantized_linear sends to quantized_gemv on CUDA: MLX_INFER_QGEMV_ROWS (0..64, 0: never),
/// read at each call, else the default (4: qgemv_cuda.cpp says why); a bad value is a std::invalid_argument naming it.
int qgemv_max_rows();

/// The tiling quantized_gemv uses for x of ``rows`` rows of ``dtype`` and a ``bits``-bit w of (n, k) values when
/// none is given. The CUDA-core form (mma false; 1-8 rows): ``rows_per_warp`` rows of w per warp, ``unroll`` 1..8
/// chunks of 16 packed bytes per lane at once. The tensor-core form (16-bit x, K bits / 32 a multiple of 16; 1-64
/// rows): ``rows_per_warp`` n-tiles of 8 rows of w per block, ``warps`` splitting K, ``unroll`` super-steps (4
/// chunks of a row) in flight per lane; the default above 4 rows.
GemvTiling default_qgemv_tiling(int rows, int n, int k, int bits, mx::Dtype dtype);

/// Whether quantized_linear takes quantized_gemv for these operands: MLX's CUDA backend, a GPU stream, 1 to
/// qgemv_max_rows() rows of x, mode "affine" with biases, 4 or 8 bits, group size 32/64/128, x, scales and
/// biases of one float dtype, w (N, K bits / 32) uint32 with K bits / 32 a multiple of 4 (above 8 rows: 16-bit x
/// and a multiple of 16, the tensor-core form).
bool quantized_gemv_applies(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    const std::string& mode = "affine",
    mx::StreamOrDevice s = {});

/// `mx::quantized_matmul(x, w, scales, biases, transpose=true, group_size, bits)` for x (..., K) of 1 to 64 rows by
/// our fused dequantizing CUDA GEMV kernels (cpp/matmul/qgemv_cuda.cpp; 1-8 rows CUDA-core, 1-64 tensor-core):
/// float32 accumulation, one rounding to x's dtype; ``tiling`` default: default_qgemv_tiling. CUDA streams only.
/// Throws std::invalid_argument naming the bad operand.
mx::array quantized_gemv(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    std::optional<GemvTiling> tiling = std::nullopt,
    mx::StreamOrDevice s = {});

/// The decode graphs' quantized `x @ dequantize(w).T`: quantized_gemv where quantized_gemv_applies, else
/// `mx::quantized_matmul(..., transpose=true, ...)`.
mx::array quantized_linear(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    const std::string& mode = "affine",
    mx::StreamOrDevice s = {});

/// The instruction set the kernels dispatch to: "avx512vnni", "avx512", "avx2"
/// or "generic". The default is the widest the CPU has except avx512vnni, which
/// is opt-in: its quantized GEMV (M <= 4) rounds x to int8 per 32 values (as
/// llama.cpp's Q8_0) for VNNI dot products instead of keeping x in float32.
std::string cpu_kernel_isa();

/// Threads the kernels use (the pool size): physical cores available to this
/// process, or MLX_INFER_CPU_THREADS when set (read once, here only).
int cpu_threads();

/// Choose the kernels' instruction set (process-wide): "avx512vnni", "avx512",
/// "avx2", "generic" (none wider than the CPU has), or "" for the default.
/// Throws std::invalid_argument for an unknown name or one the CPU lacks.
void set_cpu_kernel_isa(const std::string& isa);

}  // namespace mlx_infer
