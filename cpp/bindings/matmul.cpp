// nanobind only: the CPU kernels' ops (cpp/cpu_kernels/: products, SDPA, gated activation, LoRA update) and the CUDA products (cpp/matmul/).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>

#include <string>

#include "mlx_infer/cpu_attention.h"
#include "mlx_infer/matmul.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

void bind_matmul(nb::module_& m) {
  m.def(
      "fast_linear",
      [](const mx::array& x, const mx::array& weight, const std::optional<mx::array>& bias,
         mx::StreamOrDevice stream) { return mlx_infer::fast_linear(x, weight, bias, stream); },
      "x"_a, "weight"_a, "bias"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
      R"(``x @ weight.T (+ bias)`` with mlx-infer's CPU kernels on CPU streams.

Args:
    x: ``(..., K)`` float32, bfloat16 or float16.
    weight: ``(N, K)`` float32, bfloat16 or float16 (a Linear layer's weight).
    bias: optional ``(N,)``.
    stream: stream or device (default: the default stream).

Returns:
    ``(..., N)`` in the promoted dtype. Computed in float32 and rounded once.
    On a GPU stream, or for inputs the kernels do not cover, MLX's own
    ``matmul``/``addmm``.)");

  m.def(
      "fast_quantized_matmul",
      [](const mx::array& x, const mx::array& w, const mx::array& scales,
         const std::optional<mx::array>& biases, bool transpose, int group_size, int bits,
         const std::string& mode, mx::StreamOrDevice stream) {
        return mlx_infer::fast_quantized_matmul(x, w, scales, biases, transpose, group_size, bits,
                                                mode, stream);
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a = nb::none(), nb::kw_only(), "transpose"_a = true,
      "group_size"_a = 64, "bits"_a = 4, "mode"_a = "affine", "stream"_a = nb::none(),
      R"(``mx.quantized_matmul`` with mlx-infer's CPU kernels on CPU streams.

The kernels cover mode ``"affine"`` with biases, ``transpose=True``, bits 4
and 8, group sizes 32/64/128 and float inputs (MLX's packing: uint32 words,
``32 // bits`` values each, least significant first; ``w = scale * q + bias``
per group). They compute in float32 and round once to the output dtype.
Anything else, and every GPU stream, runs ``mx.quantized_matmul``.)");

  m.def(
      "fast_sdpa",
      [](const mx::array& q, const mx::array& k, const mx::array& v, float scale,
         const std::string& mask_mode, const std::optional<mx::array>& mask,
         mx::StreamOrDevice stream) {
        return mlx_infer::fast_sdpa(q, k, v, scale, mask_mode, mask, stream);
      },
      "q"_a, "k"_a, "v"_a, nb::kw_only(), "scale"_a, "mask_mode"_a = "", "mask"_a = nb::none(),
      "stream"_a = nb::none(),
      R"(``mx.fast.scaled_dot_product_attention`` with mlx-infer's CPU kernels on CPU streams.

Args:
    q: ``(B, H, L, D)``; k: ``(B, KVH, S, D)``; v: ``(B, KVH, S, Dv)`` (one float dtype,
        ``H`` a multiple of ``KVH``).
    scale: multiplier on ``q . k``.
    mask_mode: ``""``, ``"causal"`` (key ``s`` visible to query ``l`` when
        ``s <= l + S - L``) or ``"array"``.
    mask: with ``"array"``: bool (True = attend) or float (added to the scores),
        broadcastable to ``(B, H, L, S)``.

Returns:
    ``(B, H, L, Dv)`` in q's dtype. Scores, softmax and the weighted sum run in
    float32. A query that sees no key gets zeros (MLX: NaN). Other inputs and
    GPU streams run MLX's op.)");

  m.def(
      "fast_gated_activation",
      [](const mx::array& gate, const mx::array& up, const std::string& activation,
         mx::StreamOrDevice stream) {
        return mlx_infer::fast_gated_activation(gate, up, activation, stream);
      },
      "gate"_a, "up"_a, nb::kw_only(), "activation"_a, "stream"_a = nb::none(),
      R"(``act(gate) * up`` in one pass on CPU streams (a gated MLP's activation).

Args:
    gate, up: same shape and float dtype.
    activation: ``"gelu_approx"`` (``mlx.nn.gelu_approx``) or ``"silu"``.

Returns:
    Same shape and dtype. Computed in float32 (``x * sigmoid(z)`` with a
    vectorized exp) and rounded once. GPU streams and other inputs run the same
    formula in MLX ops.

Raises:
    ValueError: for an unknown activation.)");

  m.def(
      "fast_lora_update",
      [](const mx::array& base, const mx::array& x, const mx::array& a, const mx::array& b,
         const mx::array& slots, int slot_count, int rank, int col0, int row0,
         mx::StreamOrDevice stream) {
        return mlx_infer::fast_lora_update(base, x, a, b, slots, slot_count, rank, col0, row0, stream);
      },
      "base"_a, "x"_a, "a"_a, "b"_a, "slots"_a, nb::kw_only(), "slot_count"_a, "rank"_a, "col0"_a = 0,
      "row0"_a = 0, "stream"_a = nb::none(),
      R"(One linear's per-row LoRA update added to its base output, in one op.

``out[b, .., n] = base[b, .., n] + sum_j (x[b, ..] . a[j]) * b[row0 + n, j]`` over the
columns ``j`` of row ``b``'s slot ``s = slots[b]``: ``col0 + s * rank .. col0 + (s + 1) * rank - 1``.
Slot 0 (no adapter) and slots ``>= slot_count`` leave the row as ``base``.

Args:
    base: ``(B, .., N)`` the layer's output without the update.
    x: ``(B, .., K)`` the layer's input (base's dtype for the CPU kernel).
    a: ``(rows, K)`` the slots' A^T, concatenated (a linear weight).
    b: ``(N_all, rows)`` the slots' scaled B^T (a group: block-diagonal).
    slots: ``(B,)`` integers.
    slot_count, rank: slots and columns per slot; col0/row0: the member's first column/row.

Returns:
    ``(B, .., N)``. On CPU streams accumulated in float32 and rounded once; GPU streams and
    other dtypes run the same formula in MLX ops.

Raises:
    ValueError: for shapes that do not fit together.)");

  m.def(
      "fast_lora_linear",
      [](const mx::array& x, const mx::array& weight, const std::optional<mx::array>& bias, const mx::array& a,
         const mx::array& b, const mx::array& slots, int slot_count, int rank, int col0, int row0,
         mx::StreamOrDevice stream) {
        return mlx_infer::fast_lora_linear(x, weight, bias, a, b, slots, slot_count, rank, col0, row0, stream);
      },
      "x"_a, "weight"_a, "bias"_a, "a"_a, "b"_a, "slots"_a, nb::kw_only(), "slot_count"_a, "rank"_a,
      "col0"_a = 0, "row0"_a = 0, "stream"_a = nb::none(),
      "``fast_lora_update(fast_linear(x, weight, bias), x, a, b, slots, ...)`` as one op on CPU streams.");
  m.def(
      "fast_lora_quantized_matmul",
      [](const mx::array& x, const mx::array& w, const mx::array& scales, const std::optional<mx::array>& biases,
         const mx::array& a, const mx::array& b, const mx::array& slots, int group_size, int bits,
         int slot_count, int rank, int col0, int row0, mx::StreamOrDevice stream) {
        return mlx_infer::fast_lora_quantized_matmul(x, w, scales, biases, group_size, bits, a, b, slots,
                                                     slot_count, rank, col0, row0, stream);
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a, "a"_a, "b"_a, "slots"_a, nb::kw_only(), "group_size"_a, "bits"_a,
      "slot_count"_a, "rank"_a, "col0"_a = 0, "row0"_a = 0, "stream"_a = nb::none(),
      "``fast_lora_update(fast_quantized_matmul(x, w, scales, biases, ...), x, a, b, slots, ...)`` as one op "
      "on CPU streams (affine mode).");

  m.def(
      "tuned_linear",
      [](const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias, mx::StreamOrDevice stream) {
        return mlx_infer::tuned_linear(x, w, bias, stream);
      },
      "x"_a, "w"_a, "bias"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
      R"(``x @ w.T`` through cuBLASLt with the fastest algorithm per shape on CUDA.

Args:
    x: ``(..., K)``.
    w: ``(N, K)`` (a Linear layer's weight).
    bias: optional ``(N,)``, added in cuBLASLt's epilogue (``mx.addmm`` elsewhere).
    stream: stream or device (default: the default stream).

Returns:
    ``(..., N)``. On MLX's CUDA backend, for bfloat16 or float16 x and w (one dtype) and more than
    one row, a cuBLASLt product whose algorithm was timed against the other candidates on the
    first use of each (M, N, K, dtype) (``MLX_INFER_TUNED_PRODUCTS_LOG=1`` prints the choices).
    Everywhere else ``mx.matmul(x, w.T)`` (``mx.addmm(bias, x, w.T)``), unchanged.

Raises:
    ValueError: x's last axis is not w's K, w is not 2-D, or bias is not ``(N,)``.)");
  m.def(
      "skinny_linear",
      [](const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
         std::optional<std::tuple<int, int, int>> tiling, bool mma, mx::StreamOrDevice stream) {
        std::optional<mlx_infer::GemvTiling> t;
        if (tiling) {
          t = mlx_infer::GemvTiling{std::get<0>(*tiling), std::get<1>(*tiling), std::get<2>(*tiling), mma};
        }
        return mlx_infer::skinny_linear(x, w, bias, t, stream);
      },
      "x"_a, "w"_a, "bias"_a = nb::none(), nb::kw_only(), "tiling"_a = nb::none(), "mma"_a = false,
      "stream"_a = nb::none(),
      R"(``x @ w.T (+ bias)`` for 1 to 64 rows by the CUDA GEMV kernel the decode graphs use.

Args:
    x: ``(..., K)``, 1 to 64 rows (``x.size // K``; above 16 only the tensor-core form).
    w: ``(N, K)`` of x's dtype (bfloat16, float16 or float32), K a multiple of 16 bytes.
    bias: optional ``(N,)`` of w's dtype, added in float32 before the rounding.
    tiling: ``(rows_per_warp, warps, unroll)``; default: the tuned choice for the shape (``mma`` then unused).
    mma: with ``tiling``: the tensor-core form (16-bit, K a multiple of 32; rows_per_warp: n-tiles of 8 rows
        of w per block).
    stream: a GPU stream of MLX's CUDA backend (the kernel is compiled there by NVRTC).

Returns:
    ``(..., N)``: float32 accumulation, one rounding to the dtype.

Raises:
    ValueError: shapes, dtypes or tiling out of range.)");
  m.def("gemv_max_rows", &mlx_infer::gemv_max_rows,
        "The most rows the decode graphs' dense CUDA products send to skinny_linear (MLX_INFER_GEMV_ROWS, "
        "read at each call; 0: never).");
  m.def("gemv_max_weight_mib", &mlx_infer::gemv_max_weight_mib,
        "The largest weight (MiB) the decode graphs' dense CUDA products send to skinny_linear "
        "(MLX_INFER_GEMV_MAX_MIB, read at each call; 0: no cap).");
  m.def("l2_prefetch_o_enabled", &mlx_infer::l2_prefetch_o_enabled,
        "Whether the decode graphs prefetch each layer's o weight into the L2 after its q|k|v product on CUDA "
        "(MLX_INFER_L2_PREFETCH_O=1, read at each trace; default off; a bad value raises ValueError naming it).");
  m.def(
      "l2_prefetch",
      [](const mx::array& x, const mx::array& w) { return mlx_infer::l2_prefetch(x, w); }, "x"_a, "w"_a,
      "``x`` unchanged (a copy) from one CUDA kernel that also asks the L2 for every 128-byte line of ``w`` "
      "without waiting for it, so a later product of ``w`` reads it from the L2. CUDA only: elsewhere a clear "
      "error.");
  m.def("gemv_min_rows", &mlx_infer::gemv_min_rows,
        "The fewest rows the decode graphs' dense CUDA products send to skinny_linear (MLX_INFER_GEMV_MIN_ROWS, "
        "1 or 2, read at each call; default 2: one row stays on MLX's own GEMV).");
  m.def("gemv_takes", &mlx_infer::gemv_takes, "rows"_a, "weight_bytes"_a,
        "The routing rule alone, on any device: whether a product of this many rows of x over a weight of this "
        "many bytes goes to skinny_linear on CUDA (gemv_min_rows() <= rows <= gemv_max_rows(), the weight within "
        "gemv_max_weight_mib()).");
  m.def("skinny_linear_applies",
        [](const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias, mx::StreamOrDevice s) {
          return mlx_infer::skinny_linear_applies(x, w, bias, s);
        },
        "x"_a, "w"_a, "bias"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "Whether the decode graphs' dense product of these operands runs skinny_linear here.");
  m.def(
      "quantized_gemv",
      [](const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
         int bits, std::optional<std::tuple<int, int, int>> tiling, bool mma, mx::StreamOrDevice stream) {
        std::optional<mlx_infer::GemvTiling> t;
        if (tiling) {
          t = mlx_infer::GemvTiling{std::get<0>(*tiling), std::get<1>(*tiling), std::get<2>(*tiling), mma};
        }
        return mlx_infer::quantized_gemv(x, w, scales, biases, group_size, bits, t, stream);
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a = 64, "bits"_a = 4, nb::kw_only(),
      "tiling"_a = nb::none(), "mma"_a = false, "stream"_a = nb::none(),
      R"(``mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)`` for 1 to 64 rows by the
fused dequantizing CUDA GEMV kernels (cpp/matmul/qgemv_cuda.cpp).

Args:
    x: ``(..., K)``, 1 to 64 rows (above 8 only the tensor-core form), bfloat16, float16 or float32.
    w, scales, biases: ``mx.quantize(W, group_size, bits)`` of a ``(N, K)`` weight (mode "affine"), scales and
        biases of x's dtype; bits 4 or 8, group_size 32, 64 or 128.
    tiling: ``(rows_per_warp, warps, unroll)`` (1-4, 1-16, 1-8); default: the choice for the shape (``mma`` then
        unused).
    mma: with ``tiling``: the tensor-core form (16-bit x, K * bits / 32 a multiple of 16; rows_per_warp: n-tiles
        of 8 rows of w per block; unroll: super-steps in flight).
    stream: a GPU stream of MLX's CUDA backend (the kernel is compiled there by NVRTC).

Returns:
    ``(..., N)``: float32 accumulation, one rounding to x's dtype.

Raises:
    ValueError: operands, rows or tiling out of range, or not a CUDA stream.)");
  m.def(
      "quantized_linear",
      [](const mx::array& x, const mx::array& w, const mx::array& scales, const std::optional<mx::array>& biases,
         int group_size, int bits, const std::string& mode, mx::StreamOrDevice stream) {
        return mlx_infer::quantized_linear(x, w, scales, biases, group_size, bits, mode, stream);
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a = nb::none(), "group_size"_a = 64, "bits"_a = 4, "mode"_a = "affine",
      nb::kw_only(), "stream"_a = nb::none(),
      "The decode graphs' quantized product: quantized_gemv where quantized_gemv_applies, else "
      "``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)``.");
  m.def(
      "quantized_gemv_applies",
      [](const mx::array& x, const mx::array& w, const mx::array& scales, const std::optional<mx::array>& biases,
         int group_size, int bits, const std::string& mode, mx::StreamOrDevice stream) {
        return mlx_infer::quantized_gemv_applies(x, w, scales, biases, group_size, bits, mode, stream);
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a = nb::none(), "group_size"_a = 64, "bits"_a = 4, "mode"_a = "affine",
      nb::kw_only(), "stream"_a = nb::none(),
      "Whether the decode graphs' quantized product of these operands runs quantized_gemv here.");
  m.def(
      "default_qgemv_tiling",
      [](int rows, int n, int k, int bits, mx::Dtype dtype) {
        const auto t = mlx_infer::default_qgemv_tiling(rows, n, k, bits, dtype);
        return std::make_tuple(t.rows_per_warp, t.warps, t.unroll, t.mma);
      },
      "rows"_a, "n"_a, "k"_a, "bits"_a, "dtype"_a,
      "quantized_gemv's default ``(rows_per_warp, warps, unroll, mma)`` for x of ``rows`` rows of ``dtype`` and a "
      "``bits``-bit weight of (n, k) values.");
  m.def("qgemv_max_rows", &mlx_infer::qgemv_max_rows,
        "The most rows the decode graphs' quantized CUDA products send to quantized_gemv (MLX_INFER_QGEMV_ROWS, "
        "0..64, read at each call; 0: never).");
  m.def("tuned_products_available", &mlx_infer::tuned_products_available,
        "True where tuned_linear runs cuBLASLt: built with the CUDA toolkit and MLX's CUDA backend available.");

  m.def("cpu_kernel_isa", &mlx_infer::cpu_kernel_isa,
        "The instruction set the CPU kernels use: 'avx512vnni', 'avx512', 'avx2' or 'generic'.");
  m.def("set_cpu_kernel_isa", &mlx_infer::set_cpu_kernel_isa, "isa"_a,
        R"(Choose the CPU kernels' instruction set (process-wide; tests, benchmarks).

The default is the widest the CPU has, except ``'avx512vnni'``, which is
opt-in: its quantized GEMV (M <= 4 rows) rounds x to int8 per 32 values
(absmax scale, as llama.cpp's Q8_0) for VNNI dot products, adding at most
``sum_k |w_k| * amax(x block) / 254`` per output (~0.5% relative for Gaussian x).

Args:
    isa: 'avx512vnni', 'avx512', 'avx2', 'generic', or '' for the default.

Raises:
    ValueError: for an unknown name or one this CPU lacks.)");
  m.def("cpu_threads", &mlx_infer::cpu_threads,
        "Threads the CPU kernels run on: physical cores, or MLX_INFER_CPU_THREADS.");
}
