// Multi-head latent attention (DeepSeek V3, DecodeConfig::kv_lora_rank > 0) of the decode forward: one query
// per row, as models/deepseek_v3.py's Attention runs it for L == 1 (mlx-lm's absorbed form), op for op:
//
//   q             = q(x), or q_b(rms(q_a(x), q_a_norm))          (B, H (nope + rope))
//   q_nope | q_pe   its heads split                              (B, H, 1, nope), (B, H, 1, rope)
//   latent | k_pe = kv_a(x); latent = rms(latent, kv_a_norm)     (B, 1, 1, R), (B, 1, 1, rope)
//   q_pe, k_pe      rotated at each row's position
//   K <- latent, V <- k_pe                                       the layer's KV storage: one head
//   pe            = (q_pe * scale) @ V^T                         (B, H, 1, S), the lowest float past each
//                                                                row's length (the storage's mask)
//   out           = sdpa(embed_q(q_nope), K, K, scale, + pe)     (B, H, 1, R): the latent space
//   return          unembed_out(out)                             (B, H v_head), before o
//
// The K/V go through KVAccess::write_read: on every backend the gather path (buffers read whole, or
// the paged store's pages gathered into a contiguous copy), never a fused paged attention kernel, which
// takes neither the latent's width beside the RoPE key's nor an additive score. A prefill chunk's rows in
// the paged step are single queries too (each row its own length), so the absorbed form holds per row.
#include "graph.h"

#include "mlx_infer/cpu_attention.h"
#include "mlx_infer/matmul.h"

namespace mlx_infer {

namespace {

// q_a_layernorm and kv_a_layernorm are nn.RMSNorm(eps=1e-6) whatever the config's rms_norm_eps.
constexpr float kMlaNormEps = 1e-6f;

}  // namespace

mx::array multi_linear(const Linear& l, const mx::array& x) {
  if (l.quantized()) {  // QuantizedMultiLinear
    return quantized_linear(x, *l.w, *l.scales, l.biases, l.group_size, l.bits, l.mode);
  }
  return mx::matmul(x, mx::swapaxes(*l.w, -1, -2));  // MultiLinear: x @ weight.swapaxes(-1, -2)
}

mx::array mla_attention(const DecodeStep::Graph& g, const LayerWeights& lw, const mx::array& x,
                        const mx::array& positions, KVAccess& kv) {
  const auto& cfg = g.cfg;
  const int B = x.shape(0), H = cfg.num_heads;
  const int nope = cfg.qk_nope_head_dim, rope_dim = cfg.qk_rope_head_dim, R = cfg.kv_lora_rank;

  auto q = lw.q_a.present() ? apply_linear(lw.q_b, rms(apply_linear(lw.q_a, x), lw.q_a_norm, kMlaNormEps))
                            : apply_linear(lw.q, x);  // (B, H (nope + rope))
  q = mx::transpose(mx::reshape(q, {B, 1, H, nope + rope_dim}), {0, 2, 1, 3});  // (B, H, 1, nope + rope)
  auto q_parts = mx::split(q, mx::Shape{nope}, -1);                           // q_nope, q_pe
  auto kv_parts = mx::split(apply_linear(lw.kv_a, x), mx::Shape{R}, -1);     // (B, R), (B, rope)
  auto k_pe = mx::transpose(mx::reshape(kv_parts[1], {B, 1, 1, rope_dim}), {0, 2, 1, 3});  // (B, 1, 1, rope)
  auto latent = rms(kv_parts[0], lw.kv_a_norm, kMlaNormEps);                 // (B, R)
  auto q_pe = rope(q_parts[1], lw.rope, positions);                          // (B, H, 1, rope)
  k_pe = rope(k_pe, lw.rope, positions);
  latent = mx::reshape(latent, {B, 1, 1, R});  // (B, 1, 1, R)

  const auto in = kv.write_read(lw.buffer, latent, k_pe);  // keys (B, 1, S, R), values (B, 1, S, rope)
  auto pe = mx::matmul(mx::multiply(q_pe, scalar(cfg.attn_scale, q_pe.dtype())),
                       mx::swapaxes(in.values, -1, -2));  // (B, H, 1, S)
  if (in.mask) {
    pe = mx::where(*in.mask, pe, mx::array(static_cast<float>(mx::finfo(pe.dtype()).min), pe.dtype()));
  }
  auto q_nope = multi_linear(lw.embed_q, q_parts[0]);  // (B, H, 1, R)
  auto out = g.fast_attention  // the model's attention module on mlx-infer's CPU kernel (no q LoRA: it has q_proj)
      ? fast_sdpa(q_nope, in.keys, in.keys, cfg.attn_scale, "array", pe)
      : mx::fast::scaled_dot_product_attention(q_nope, in.keys, in.keys, cfg.attn_scale, "array", pe);  // (B, H, 1, R)
  out = multi_linear(lw.unembed_out, out);  // (B, H, 1, v_head)
  return mx::reshape(mx::transpose(out, {0, 2, 1, 3}), {B, H * cfg.v_head_dim});  // (B, H v_head)
}

}  // namespace mlx_infer
