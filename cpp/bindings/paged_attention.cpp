// nanobind only: paged attention through block tables (cpp/attention/paged_attention.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "mlx_infer/backend.h"
#include "mlx_infer/paged_attention.h"
#include "../attention/paged_attention_cuda.h"
#include "../attention/qkv_rope_cuda.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

void bind_paged_attention(nb::module_& m) {
  m.def(
      "paged_attention",
      [](const mx::array& q, const mx::array& k_storage, const mx::array& v_storage, const mx::array& block_tables,
         const mx::array& lengths, int window, float scale, float softcap, const std::optional<mx::array>& sinks,
         const std::string& impl, mx::StreamOrDevice stream) {
        if (impl == "gather") {
          return mlx_infer::paged_attention_gather(q, k_storage, v_storage, block_tables, lengths, window, scale,
                                                   softcap, sinks, stream);
        }
        if (impl != "auto") {
          throw std::invalid_argument("[paged_attention] impl must be \"auto\" or \"gather\", got \"" + impl + "\".");
        }
        return mlx_infer::paged_attention(q, k_storage, v_storage, block_tables, lengths, window, scale, softcap,
                                          sinks, stream);
      },
      "q"_a, "k_storage"_a, "v_storage"_a, "block_tables"_a, "lengths"_a, nb::kw_only(), "window"_a = 0,
      "scale"_a, "softcap"_a = 0.0f, "sinks"_a = nb::none(), "impl"_a = "auto", "stream"_a = nb::none(),
      R"(Attention of one query token per row, reading K/V through block tables.

Args:
    q: ``(R, H, D)`` queries.
    k_storage, v_storage: ``(pages, KVH, P, D)`` a layer's page storage; ``H % KVH == 0`` (GQA).
    block_tables: ``(R, T)`` int32: row r's logical page j is storage page ``block_tables[r, j]``.
    lengths: ``(R,)`` int32: row r attends to the keys at positions
        ``[max(0, length - window), length)``.
    window: sliding window (``<= 0``: none).
    scale: score scale.
    softcap: ``> 0``: each score ``s = scale * q.k`` becomes ``softcap * tanh(s / softcap)`` before
        the softmax (Gemma 2's ``attn_logit_softcapping``); ``0``: no cap.
    sinks: ``(H,)`` per-head sink logits (gpt-oss): each joins its head's softmax as one more
        score with no value, as ``mx.fast.scaled_dot_product_attention(..., sinks=)``; or ``None``.
    impl: ``"auto"`` (the kernel of the stream's backend: CPU or CUDA; the gather
        reference on Metal) or ``"gather"`` (the reference: gather, then MLX SDPA, or with a
        soft cap the composed attention of ``mlx_infer.layers.attention.softcapped_attention``).
    stream: stream or device.

Returns:
    ``(R, H, D)`` in q's dtype, accumulated in float32. A row with length 0 gets zeros
    from the kernels (the gather reference has no keys to attend then).)");

  m.def(
      "paged_attention_backend",
      [](const mx::array& q, const mx::array& k_storage, mx::StreamOrDevice stream) {
        return mlx_infer::paged_attention_backend(q, k_storage, stream);
      },
      "q"_a, "k_storage"_a, nb::kw_only(), "stream"_a = nb::none(),
      "``\"cpu\"``, ``\"cuda\"`` or ``\"gather\"``: what ``paged_attention(impl=\"auto\")`` runs for these inputs.");

  m.def("paged_attention_splits", &mlx_infer::paged_attention_splits, "rows"_a, "kv_heads"_a, "max_keys"_a,
        "The CUDA kernels' split-K count for rows x KV heads over at most max_keys keys (1: no split).");
  m.def(
      "qkv_rope",
      [](const mx::array& qkv, const mx::array& positions, int heads, int kv_heads, int head_dim, int dims,
         bool traditional, std::optional<float> base, float scale, const std::optional<mx::array>& freqs,
         const std::optional<mx::array>& q_norm, const std::optional<mx::array>& k_norm, float eps) {
        mlx_infer::RopeSpec r;
        r.dims = dims;
        r.traditional = traditional;
        r.base = base;
        r.scale = scale;
        r.freqs = freqs;
        if (base.has_value() == freqs.has_value()) {
          throw std::invalid_argument("[qkv_rope] give exactly one of base and freqs.");
        }
        if (positions.ndim() != 1 || qkv.ndim() != 2 || positions.shape(0) != qkv.shape(0)) {
          throw std::invalid_argument("[qkv_rope] qkv must be (R, (H + 2 KVH) D) and positions (R,).");
        }
        if (q_norm.has_value() != k_norm.has_value()) {
          throw std::invalid_argument("[qkv_rope] give both q_norm and k_norm, or neither.");
        }
        std::optional<mlx_infer::QkNorm> qk;
        if (q_norm) {
          qk = mlx_infer::QkNorm{*q_norm, *k_norm, eps};
        }
        const mlx_infer::QkNorm* norm = qk ? &*qk : nullptr;
        if (!mlx_infer::qkv_rope_supported(qkv, heads, kv_heads, head_dim, r, norm)) {
          throw std::invalid_argument(
              "[qkv_rope] runs on MLX's CUDA backend (default device the GPU) with qkv (R, (H + 2 KVH) D) of a "
              "float dtype and even head_dim and dims <= head_dim (q_norm, k_norm: (head_dim,) of qkv's dtype, "
              "head_dim <= 2048); elsewhere the graphs use mx.fast.rope.");
        }
        auto out = mlx_infer::qkv_rope(qkv, heads, kv_heads, head_dim, r, positions, false, norm);
        return std::make_tuple(out[0], out[1], out[2]);
      },
      "qkv"_a, "positions"_a, nb::kw_only(), "heads"_a, "kv_heads"_a, "head_dim"_a, "dims"_a,
      "traditional"_a = false, "base"_a = nb::none(), "scale"_a = 1.0f, "freqs"_a = nb::none(),
      "q_norm"_a = nb::none(), "k_norm"_a = nb::none(), "eps"_a = 1e-6f,
      "A fused q|k|v product's output ``(R, (H + 2 KVH) D)`` as contiguous ``q (R, H, D)``, ``k, v (R, KVH, D)``, "
      "q and k rotated at ``positions (R,)`` as ``mx.fast.rope`` rotates them: one CUDA kernel (the paged step's "
      "on CUDA). With ``q_norm`` and ``k_norm`` ((D,) weights) each q and k head is first "
      "``mx.fast.rms_norm(head, w, eps)`` (gemma3's and qwen3's per-head norms). CUDA only: elsewhere a clear "
      "error.");
  m.def("qkv_rope_norm_enabled", &mlx_infer::qkv_rope_norm_enabled,
        "Whether the paged step on CUDA hands per-head q/k norms (gemma3, qwen3) to qkv_rope (default on; "
        "MLX_INFER_QKV_ROPE_NORM=0 off, read at each trace; a bad value raises ValueError naming it).");
  m.def(
      "paged_key_pipeline",
      [] {
        const auto p = mlx_infer::paged_key_pipeline();
        return std::make_tuple(p.unroll, p.prefetch);
      },
      "The CUDA paged-attention kernel's key pipeline ``(unroll, prefetch)`` as the next trace reads it: "
      "MLX_INFER_PAGED_ATTN_UNROLL (1..8) and MLX_INFER_PAGED_ATTN_PREFETCH (0/1), else the tuned defaults; "
      "a bad value raises ValueError naming the variable.");
  m.def("rope_rows_per_call", &mlx_infer::rope_rows_per_call, "rows"_a, "heads"_a, "tokens"_a, "dims"_a,
        nb::kw_only(), "cuda"_a = mlx_infer::cuda_backend(),
        "Rows per mx.fast.rope call in the compiled steps: all of them, except where MLX's CUDA RoPE kernel would "
        "get a thread block deeper than CUDA's 64 in z (rotary dims < 32 with 128+ groups of 4 heads).");
  m.def("reuse_kernels_enabled", &mlx_infer::reuse_kernels_enabled,
        "Whether the custom CUDA kernels' launches reuse their primitive per signature (MLX_INFER_REUSE_KERNELS, "
        "read at each launch; '0' turns it off).");
  m.def(
      "reused_kernel_probe",
      [](const std::vector<std::pair<mx::array, mx::array>>& pairs) {
        // ReusedKernel over a function any backend runs (MLX's add): the cache and the reuse, off CUDA.
        mlx_infer::ReusedKernel k([](const std::vector<mx::array>& in, const std::vector<mx::Shape>&,
                                     const std::vector<mx::Dtype>&, std::tuple<int, int, int>,
                                     std::tuple<int, int, int>,
                                     std::vector<std::pair<std::string, mx::fast::TemplateArg>>,
                                     std::optional<float>, bool, mx::StreamOrDevice s) {
          return std::vector<mx::array>{mx::add(in[0], in[1], s)};
        });
        std::vector<mx::array> outs;
        for (const auto& [a, b] : pairs) {
          const auto dtype = mx::promote_types(a.dtype(), b.dtype());
          outs.push_back(k({a, b}, {mx::broadcast_shapes(a.shape(), b.shape())}, {dtype}, {1, 1, 1}, {1, 1, 1},
                           {{"T", dtype}}, std::nullopt, false, {})[0]);
        }
        return std::make_pair(outs, k.signatures());
      },
      "pairs"_a,
      "Tests: ``a + b`` for each pair through a ReusedKernel wrapping MLX's add (its template argument the "
      "result's dtype); returns the sums and how many primitives it made.");
}
