// nanobind only: the compiled decode step (DecodeConfig, RopeSpec, DecodeStep).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unordered_map.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "mlx_infer/decode.h"
#include "mlx_infer/paged_decode.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
using mlx_infer::DecodeConfig;
using mlx_infer::DecodeStep;
using mlx_infer::LoraInputs;
using mlx_infer::PagedDecodeConfig;
using mlx_infer::PagedDecodeStep;
using mlx_infer::PagedGroupInputs;
using mlx_infer::RopeSpec;

namespace {

LoraInputs lora_inputs(std::vector<std::string> targets, std::vector<mx::array> a, std::vector<mx::array> b,
                       std::vector<mx::array> scales, std::vector<std::optional<mx::array>> g) {
  return LoraInputs{std::move(targets), std::move(a), std::move(b), std::move(scales), std::move(g)};
}

constexpr const char* kSetAdaptersDoc = R"(The adapter bank's stacked tensors, inputs of every later step
(see mlx_infer/lora.h); empty lists remove them. A new set of targets retraces the compiled step,
new values of the same shapes do not.

Args:
    targets: canonical linear names (``layers.0.q``).
    a: per target ``(S, in, r)``; b: per target ``(S, r, out)``; scales: per target ``(S,)``.
    g: per target ``(S, out)`` DoRA gains, or None.

Raises:
    ValueError: a target the step has no linear for, or shapes that do not agree.)";

}  // namespace

void bind_decode(nb::module_& m) {
  nb::class_<RopeSpec>(m, "RopeSpec",
                       "One layer's RoPE, as ``mx.fast.rope`` takes it (exactly one of base/freqs).")
      .def(
          "__init__",
          [](RopeSpec* r, int dims, bool traditional, std::optional<float> base, float scale,
             std::optional<mx::array> freqs, float mscale, std::optional<mx::array> long_freqs, int original) {
            new (r) RopeSpec{dims, traditional, base, scale, std::move(freqs), mscale, std::move(long_freqs),
                             original};
          },
          nb::kw_only(), "dims"_a, "traditional"_a = false, "base"_a = nb::none(),
          "scale"_a = 1.0f, "freqs"_a = nb::none(), "mscale"_a = 1.0f, "long_freqs"_a = nb::none(),
          "original"_a = 0,
          "LongRoPE (Phi-3): ``freqs`` the short table, ``long_freqs`` the long one, ``mscale`` its "
          "attention_factor; a row whose call ends past ``original`` rotates with the long table.")
      .def_ro("dims", &RopeSpec::dims)
      .def_ro("traditional", &RopeSpec::traditional)
      .def_ro("base", &RopeSpec::base)
      .def_ro("scale", &RopeSpec::scale)
      .def_ro("mscale", &RopeSpec::mscale)
      .def_ro("original", &RopeSpec::original);

  nb::class_<DecodeConfig>(m, "DecodeConfig",
                           R"(The graph a DecodeStep runs (shapes and family switches).

Fields mirror ``cpp/include/mlx_infer/decode.h``; ``windows`` and ``ropes``
hold one entry per layer (window 0 = global attention).)")
      .def(nb::init<>())
      .def_rw("family", &DecodeConfig::family)
      .def_rw("num_layers", &DecodeConfig::num_layers)
      .def_rw("hidden_size", &DecodeConfig::hidden_size)
      .def_rw("num_heads", &DecodeConfig::num_heads)
      .def_rw("num_kv_heads", &DecodeConfig::num_kv_heads)
      .def_rw("head_dim", &DecodeConfig::head_dim)
      .def_rw("vocab_size", &DecodeConfig::vocab_size)
      .def_rw("rms_norm_eps", &DecodeConfig::rms_norm_eps)
      .def_rw("attn_scale", &DecodeConfig::attn_scale)
      .def_rw("attn_softcap", &DecodeConfig::attn_softcap,
              "Attention scores soft-capped, cap * tanh(scores / cap), before the softmax (gemma2); 0 = none.")
      .def_rw("activation", &DecodeConfig::activation, "'silu', 'gelu_tanh' or 'swiglu_oai' (gpt_oss).")
      .def_rw("swiglu_limit", &DecodeConfig::swiglu_limit,
              "swiglu_oai: the gate clipped from above and the linear part to +-this (gpt_oss's swiglu_limit).")
      .def_rw("moe_softmax_topk", &DecodeConfig::moe_softmax_topk,
              "Routed experts: the softmax over the k chosen router logits (gpt_oss); else over all of them.")
      .def_rw("embed_scale", &DecodeConfig::embed_scale, "Embedding multiplier; 0 = none.")
      .def_rw("residual_scale", &DecodeConfig::residual_scale,
              "Each sublayer's output times this before its residual add (granite); 1 = none.")
      .def_rw("logits_divisor", &DecodeConfig::logits_divisor, "The logits over this (granite); 1 = none.")
      .def_rw("pre_norms", &DecodeConfig::pre_norms,
              "A norm before attention and before the MLP (false: olmo2's post-norms only).")
      .def_rw("norm_topk_prob", &DecodeConfig::norm_topk_prob,
              "The top-k routing weights renormalized to sum to 1 (qwen3_moe).")
      .def_rw("qk_norm_whole", &DecodeConfig::qk_norm_whole,
              "q/k norms over the whole projection before the heads split (olmo2); else per head.")
      .def_rw("clip_f16_residual", &DecodeConfig::clip_f16_residual)
      .def_rw("final_logit_softcap", &DecodeConfig::final_logit_softcap)
      .def_rw("windows", &DecodeConfig::windows)
      .def_rw("ropes", &DecodeConfig::ropes)
      .def_rw("kv_dtype", &DecodeConfig::kv_dtype,
              "'bfloat16', 'float16', 'float32' or '' (the model's dtype): the dtype the caller keeps its K/V in.")
      .def_rw("max_capacity", &DecodeConfig::max_capacity,
              "Most tokens a row may hold; 0 = unbounded. A step past it raises RuntimeError.")
      .def_rw("compile", &DecodeConfig::compile,
              "Compile the whole step (masked attention over the buffers' whole length).")
      .def_rw("compile_min_batch", &DecodeConfig::compile_min_batch,
              R"(Compile only for batches of at least this many rows; smaller ones
build the graph each step and read exact-length KV views without a mask.)")
      .def_rw("cpu_kernel_linears", &DecodeConfig::cpu_kernel_linears,
              "Linears (``embed``: the tied head) whose products run on mlx-infer's CPU kernels.")
      .def_rw("fuse_projections", &DecodeConfig::fuse_projections,
              "Run q|k|v and gate|up as one matmul each (holds a fused copy of those weights).")
      .def_rw("tuned_products", &DecodeConfig::tuned_products,
              R"(Dense bfloat16/float16 products through ``tuned_linear`` (cuBLASLt's fastest algorithm
per shape on CUDA; ``mx.matmul`` elsewhere, so harmless off CUDA).)")
      .def_rw("tp_backend", &DecodeConfig::tp_backend,
              "Tensor parallel: the mx.distributed backend of the group ('' = one process).")
      .def_rw("vocab_parallel", &DecodeConfig::vocab_parallel,
              "Tensor parallel: embed / lm_head hold vocabulary rows from vocab_start on.")
      .def_rw("vocab_start", &DecodeConfig::vocab_start, "Tensor parallel: the first vocabulary row held here.")
      .def_rw("per_layer_vocab_start", &DecodeConfig::per_layer_vocab_start,
              "Tensor parallel, gemma4: the first row of the per-layer input table held here.")
      .def_rw("expert_start", &DecodeConfig::expert_start,
              "Tensor parallel, gemma4: the first expert held here (expert parallel).")
      .def_rw("layer_kv_heads", &DecodeConfig::layer_kv_heads,
              "KV heads per layer (gemma4; empty = num_kv_heads everywhere).")
      .def_rw("layer_head_dims", &DecodeConfig::layer_head_dims,
              "Head dim per layer (gemma4; empty = head_dim everywhere).")
      .def_rw("kv_donors", &DecodeConfig::kv_donors,
              R"(Per layer, -1 when it owns a KV buffer, else the earlier layer whose
buffer it reads (KV sharing: gemma4). Empty = every layer owns one.)")
      .def_rw("v_from_k", &DecodeConfig::v_from_k,
              R"(Per layer, 1 where V is K's projection and the layer has no v weights
(gemma4's attention_k_eq_v). Empty = every layer has its own.)")
      .def_rw("v_norm", &DecodeConfig::v_norm, "V RMS-normed (no weight) before it is cached (gemma4).")
      .def_rw("per_layer_width", &DecodeConfig::per_layer_width,
              "Per-layer input width (gemma4; 0 = no per-layer inputs).")
      .def_rw("layer_scalars", &DecodeConfig::layer_scalars,
              "Each layer's output times its ``layers.{i}.layer_scalar`` (gemma4).")
      .def_rw("num_experts", &DecodeConfig::num_experts,
              "Experts of the MoE layers (those with a router; 0 = none).")
      .def_rw("top_k_experts", &DecodeConfig::top_k_experts, "Experts routed per token.")
      .def_rw("moe_beside_mlp", &DecodeConfig::moe_beside_mlp,
              R"(The experts run beside the dense MLP, with their own norms, the router
on rms(h) * router_scale and per-expert scales (gemma4); else instead of it
(qwen3_moe, gpt_oss).)")
      .def_rw("moe_noaux_tc", &DecodeConfig::moe_noaux_tc,
              R"(noaux_tc routing (deepseek_v3): sigmoid scores plus the selection-only
``layers.{i}.router.correction_bias``, the top k within the best moe_topk_groups
of moe_groups groups, weights from the uncorrected scores times routed_scaling_factor.)")
      .def_rw("moe_groups", &DecodeConfig::moe_groups, "noaux_tc: expert groups (n_group).")
      .def_rw("moe_topk_groups", &DecodeConfig::moe_topk_groups, "noaux_tc: groups kept per token (topk_group).")
      .def_rw("routed_scaling_factor", &DecodeConfig::routed_scaling_factor,
              "noaux_tc: the routing weights' multiplier.")
      .def_rw("kv_lora_rank", &DecodeConfig::kv_lora_rank,
              R"(Multi-head latent attention (deepseek_v3) when > 0: each layer caches one
KV head, K the normed latent (this wide; head_dim must equal it) and V the
RoPE key (qk_rope_head_dim wide). 0 = grouped-query attention.)")
      .def_rw("qk_nope_head_dim", &DecodeConfig::qk_nope_head_dim, "MLA: the queries' non-rotated width per head.")
      .def_rw("qk_rope_head_dim", &DecodeConfig::qk_rope_head_dim, "MLA: the rotated width (queries and the key).")
      .def_rw("v_head_dim", &DecodeConfig::v_head_dim, "MLA: the output width per head.");

  nb::class_<DecodeStep>(
      m, "DecodeStep",
      R"(A one-token decode step over K/V it does not own (see decode.h).

Each call takes every KV-owning layer's key and value buffers (the plain
caches' own arrays, mlx-lm's layout) with where the new token goes and how
much attention reads, and returns the logits and the updated buffers; the
caller holds those in place of the ones it passed, and drops the old ones so
MLX writes in place. A call that raises returns nothing and changes nothing.
Not thread-safe.)")
      .def(nb::init<DecodeConfig, const std::unordered_map<std::string, mx::array>&,
                    const std::unordered_map<std::string, mlx_infer::QuantSpec>&>(),
           "config"_a, "weights"_a, "quantization"_a,
           R"(Args:
    config: a DecodeConfig.
    weights: canonical name -> array (``embed.weight``, ``layers.0.q.weight``, ...).
    quantization: linear name -> ``(group_size, bits, mode)`` for quantized linears.)")
      .def(
          "set_adapters",
          [](DecodeStep& self, std::vector<std::string> targets, std::vector<mx::array> a,
             std::vector<mx::array> b, std::vector<mx::array> scales, std::vector<std::optional<mx::array>> g) {
            self.set_adapters(lora_inputs(std::move(targets), std::move(a), std::move(b), std::move(scales),
                                          std::move(g)));
          },
          "targets"_a, "a"_a, "b"_a, "scales"_a, "g"_a, kSetAdaptersDoc)
      .def_prop_ro("adapter_targets", &DecodeStep::adapter_targets, "Targets of the adapters set.")
      .def(
          "step",
          [](DecodeStep& self, const mx::array& tokens, const std::vector<int>& positions,
             const std::vector<std::vector<int>>& slots, const std::vector<std::vector<int>>& reads,
             const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
             const std::optional<mx::array>& adapter_slots) {
            auto out = self.step(tokens, positions, slots, reads, keys, values, adapter_slots);
            return std::make_tuple(out.logits, std::move(out.keys), std::move(out.values));
          },
          "tokens"_a, "positions"_a, "slots"_a, "reads"_a, "keys"_a, "values"_a, "adapter_slots"_a = nb::none(),
          R"(One new token per row; returns ``(logits (B, vocab), keys, values)``, lazily.

Args:
    tokens: ``(B,)`` integer ids.
    positions: B ints, each row's new token's position.
    slots: per window group (``window_groups``) B ints: the slot the new token is written to.
    reads: per window group B ints: the leading slots attention reads after the write.
    keys, values: per KV-owning layer ``(B, kv_heads, S, head_dim)``.
    adapter_slots: ``(B,)`` each row's bank slot (with adapters set; None = no adapter).

Raises:
    ValueError: bad tokens, counts, shapes, slots or read lengths.
    RuntimeError: max_capacity reached.)")
      .def_prop_ro("window_groups", &DecodeStep::window_groups,
                   "The distinct windows of the KV-owning layers, ascending (0 = global).")
      .def_prop_ro("traces", &DecodeStep::traces,
                   "Times the compiled step was traced (one per input-shape signature seen).")
      .def_prop_ro("steps", &DecodeStep::steps, "Steps built so far.")
      .def_prop_ro("config", &DecodeStep::config, nb::rv_policy::copy);

  nb::class_<PagedDecodeConfig>(m, "PagedDecodeConfig",
                                "Shape-independent choices of a PagedDecodeStep (see paged_decode.h).")
      .def(nb::init<>())
      .def_rw("layer_groups", &PagedDecodeConfig::layer_groups,
              "Per layer, the index of its layer group (the gather it reads), 0..G-1.")
      .def_rw("compile", &PagedDecodeConfig::compile,
              "mx.compile the step (S bucketed); off builds the graph op by op at the exact S.")
      .def_rw("t_bucket", &PagedDecodeConfig::t_bucket,
              "Compiled: round each group's block-table width T (pages) up to a multiple of this.")
      .def_rw("pad_rows", &PagedDecodeConfig::pad_rows,
              "Compiled: pad R and M up to buckets (powers of two to 16, then multiples of 16).")
      .def_rw("attention", &PagedDecodeConfig::attention,
              "\"kernel\" (paged_attention through the tables; the gather path on Metal) or \"gather\".");

  nb::class_<PagedDecodeStep>(
      m, "PagedDecodeStep",
      R"(A one-token decode step over paged K/V it does not own (see paged_decode.h).

Each call takes the page storage of every layer and returns the updated
storage; the caller replaces its arrays with them (the commit) and drops the
old ones so MLX writes in place. A call that raises changes nothing. Not
thread-safe.)")
      .def(nb::init<DecodeConfig, PagedDecodeConfig, const std::unordered_map<std::string, mx::array>&,
                    const std::unordered_map<std::string, mlx_infer::QuantSpec>&>(),
           "config"_a, "paged"_a, "weights"_a, "quantization"_a,
           R"(Args:
    config: a DecodeConfig (its kv_dtype, capacity and compile fields are unused).
    paged: a PagedDecodeConfig.
    weights: canonical name -> array, as DecodeStep takes them.
    quantization: linear name -> ``(group_size, bits, mode)``.)")
      .def(
          "step",
          [](PagedDecodeStep& self, const mx::array& tokens, const mx::array& positions, const mx::array& logit_rows,
             const std::vector<std::tuple<mx::array, mx::array, mx::array>>& groups,
             const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
             const std::optional<mx::array>& adapter_slots, const std::optional<mx::array>& call_ends) {
            std::vector<PagedGroupInputs> gs;
            gs.reserve(groups.size());
            for (const auto& [tables, lengths, slots] : groups) {
              gs.push_back(PagedGroupInputs{tables, lengths, slots});
            }
            // The graph is built (and, first time per signature, traced) without the GIL: MLX's graph state
            // is per thread (tracing, compile cache, default streams), and a server's event loop streams
            // meanwhile instead of waiting for the engine thread's C++ (a GIL profile of `mlx-infer serve`,
            // H200, session 16: 19 of its 55 samples of the GIL holder were in this call).
            auto out = [&] {
              nb::gil_scoped_release nogil;
              return self.step(tokens, positions, logit_rows, gs, keys, values, adapter_slots, call_ends);
            }();
            return std::make_tuple(out.logits, std::move(out.keys), std::move(out.values));
          },
          "tokens"_a, "positions"_a, "logit_rows"_a, "groups"_a, "keys"_a, "values"_a,
          "adapter_slots"_a = nb::none(), nb::kw_only(), "call_ends"_a = nb::none(),
          R"(One query token per row; returns ``(logits (M, vocab), keys, values)``, lazily.

Args:
    tokens: ``(R,)`` ids (a decode row, or one token of a prefill chunk).
    positions: ``(R,)`` positions of the rows' tokens.
    logit_rows: ``(M,)`` int32 rows whose logits are returned, in that order.
    groups: per layer group ``(block_tables (R, T), lengths (R,), write_slots (R,))`` int32:
        row r's pages in the group's storage (0-padded), ``position + 1``, and
        ``page * page_size + offset`` where its new K/V goes.
    keys, values: per layer the storage ``(pages, kv_heads, page_size, head_dim)``.
    adapter_slots: ``(R,)`` each row's bank slot (with adapters set; None = slot 0, no adapter).
    call_ends: ``(R,)`` the end of each row's call (``StepPlan.call_ends``: a prefill chunk's rows
        share start + n), which picks a LongRoPE layer's table; None = ``positions + 1``.

Returns:
    The logits and each layer's updated key and value storage.

Raises:
    ValueError: inputs of the wrong count, shape or dtype (quantized storage included).)")
      .def(
          "set_adapters",
          [](PagedDecodeStep& self, std::vector<std::string> targets, std::vector<mx::array> a,
             std::vector<mx::array> b, std::vector<mx::array> scales, std::vector<std::optional<mx::array>> g) {
            self.set_adapters(lora_inputs(std::move(targets), std::move(a), std::move(b), std::move(scales),
                                          std::move(g)));
          },
          "targets"_a, "a"_a, "b"_a, "scales"_a, "g"_a, kSetAdaptersDoc)
      .def_prop_ro("traces", &PagedDecodeStep::traces,
                   "Times the compiled step was traced (one per input-shape signature).")
      .def_prop_ro("retraces", &PagedDecodeStep::retraces,
                   "Traces of a shape signature traced before (0 when the compile cache works).")
      .def_prop_ro("signatures", &PagedDecodeStep::signatures,
                   "Distinct input-shape signatures the compiled step ran with.")
      .def_prop_ro("steps", &PagedDecodeStep::steps)
      .def_prop_ro("attention_backend", &PagedDecodeStep::attention_backend,
                   "What the last built or traced step's attention ran on: \"cpu\", \"cuda\" or \"gather\".")
      .def_prop_ro("num_groups", &PagedDecodeStep::num_groups)
      .def_prop_ro("config", &PagedDecodeStep::config, nb::rv_policy::copy)
      .def_prop_ro("paged_config", &PagedDecodeStep::paged_config, nb::rv_policy::copy);
}
