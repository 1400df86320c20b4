"""DeepSeek V3 through the compiled decode steps: multi-head latent attention, noaux_tc routed experts.

Models: tests/families.py's ``deepseek_v3`` (q LoRA, 3 layers, the first dense, 8 experts in 2 groups, top 2,
a shared expert, routed_scaling_factor 2.5), ``deepseek_v3_yarn`` (YaRN RoPE, its mscale in the softmax scale)
and ``deepseek_v3_no_q_lora_tied`` (q_proj, every layer MoE, one group, no renormalization, tied head), the
checkpoints transformers saved, loaded by the loader, float32, on MLX's stock kernels and on mlx-infer's CPU
kernels; and a 4-bit graph of our own whose per-head embed_q / unembed_out are QuantizedMultiLinear (the
tiny checkpoints' 16-wide nope heads take no 4-bit group).

Oracle: the eager graph (``models/deepseek_v3.py``: the absorbed attention, MLX's SDPA with the RoPE scores as
its additive mask, ``group_expert_select``) over its plain caches, or over the paged store's caches for the
paged step. Prompts of 12 tokens and 24 steps after. Checks:

- plain step (traced and built per step): greedy tokens equal, teacher-forced logits within :data:`ATOL`;
- paged step, B=6 rows of different lengths, with attention "kernel" and "gather": both take the gather path
  (MLA has no paged kernel), logits within :data:`ATOL` of the eager graph's, same argmax, every step; the
  pages it wrote equal the eager graph's (the null page aside: padding rows write there);
- prompt chunks riding in the compiled paged step (mixed steps: several rows of one sequence) give the
  separate-prefill engine's and the plain model's greedy tokens;
- the routing's correction bias is really read: shifted, it moves the eager logits by more than
  :data:`MOVED_MIN`, and the steps built from that model still match it;
- bfloat16: the plain step's logits within :data:`BF16_ATOL`;
- a tensor-parallel graph is refused with a reason (the eager graph decodes it).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from families import hf_setup
from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep
from mlx_infer.generation.bindings.graph_spec import DecodePolicy, DecodeStepUnsupported, graph_spec
from mlx_infer.models import get_model_classes
from mlx_infer.models.deepseek_v3 import QuantizedMultiLinear
from mlx_infer.state.paged import PagedKVStore
from test_gemma2_decode_step import KERNELS, STEPS, max_diff, model_of, run_plain
from test_gemma2_decode_step import paged_run as gemma2_paged_run

# Float32, logits up to ~5. Measured on CPU (mlx 0.32.4) max |step - eager| over 24 steps: 0.0 (bit-identical)
# on stock kernels, plain and paged, dense and 4-bit; <= 3.5e-6 with the CPU kernels (deepseek_v3_no_q_lora_tied,
# whose attention module is swapped: the compiled step's fused graph sums in another order).
ATOL = 1e-4
BF16_ATOL = 0.1  # bfloat16 logits up to ~5 (an ulp there is 0.03); measured 0.0 on CPU
MOVED_MIN = 0.1  # the least the eager logits move when the correction bias is shifted (measured ~2)
NAMES = ["deepseek_v3", "deepseek_v3_yarn", "deepseek_v3_no_q_lora_tied"]

#: Our own graph with every product's input width a multiple of 64, so 4-bit (group 32) quantizes embed_q /
#: unembed_out too and MLX's CUDA quantized products take every one (K % 64: their reference on a GPU).
OWN = dict(model_type="deepseek_v3", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
           num_attention_heads=4, moe_intermediate_size=64, n_shared_experts=1, n_routed_experts=8,
           routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=8, qk_nope_head_dim=64,
           v_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
           rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False)

def quantized_own_model():
    """OWN with random weights (every parameter plus N(0, 0.1): the router's start at zero), quantized to 4 bits."""
    cls, args = get_model_classes("deepseek_v3")
    mx.random.seed(5)
    model = cls(args.from_dict(OWN))
    model.update(tree_map(lambda p: p + 0.1 * mx.random.normal(p.shape), model.parameters()))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def assert_plain_matches(model, compile_: bool, label: str) -> None:
    """The plain step's tokens equal the eager graph's, greedy and teacher-forced, logits within ATOL."""
    policy = DecodePolicy(compile=compile_, compile_min_batch=1)
    for forced in (None, mx.random.randint(3, 300, (STEPS,), key=mx.random.key(7)).astype(mx.uint32)):
        want, want_logits = run_plain(model, forced, None)
        step = CompiledDecodeStep(model, policy=policy)
        got, got_logits = run_plain(model, forced, step)
        assert step.failures == 0 and step.native.steps == STEPS
        assert got == want
        diff = max_diff(got_logits, want_logits)
        print(f"{label} compile={compile_} forced={forced is not None}: {diff:.2e}")
        assert diff <= ATOL
    assert len(set(want)) > 3, want  # a near-constant stream would hide a wrong step


def paged_run(model, mode: str) -> tuple[list[mx.array], PagedKVStore]:
    """Teacher-forced logits of 6 rows through ``mode`` and the store after; MLA's attention is the
    gather path whatever the policy says."""
    return gemma2_paged_run(model, mode, backend="gather")


def assert_paged_matches(model, label: str) -> None:
    want, store_e = paged_run(model, "eager")
    for mode in ("kernel", "gather"):
        got, store_c = paged_run(model, mode)
        diff = max_diff(got, want)
        print(f"{label} paged {mode}: {diff:.2e}")
        assert diff <= ATOL
        for g, w in zip(got, want):
            assert mx.array_equal(mx.argmax(g, -1), mx.argmax(w, -1)).item()
        for se, sc in zip(store_e.storage, store_c.storage):  # the latent (K) and the RoPE key (V) it wrote
            assert se.keys[0].shape[1:] == sc.keys[0].shape[1:] and se.values[0].shape == sc.values[0].shape
            for a, b in ((se.keys[0], sc.keys[0]), (se.values[0], sc.values[0])):
                assert mx.allclose(a[1:], b[1:], atol=ATOL).item()  # page 0: the null page padding rows write


def test_spec_carries_the_latent_attention_and_the_routing():
    unfused = DecodePolicy(fuse_projections=False)  # the names below; a GPU fuses gate|up by default
    model = model_of("deepseek_v3")
    args, attn = model.args, model.layers[0].self_attn
    cfg, weights, _ = graph_spec(model, policy=unfused)
    assert (cfg.family, cfg.num_kv_heads, cfg.head_dim) == ("deepseek_v3", 1, args.kv_lora_rank)
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (32, 16, 8, 16)
    assert cfg.attn_scale == pytest.approx(attn.scale) and cfg.ropes[0].traditional  # interleaved RoPE
    assert (cfg.moe_noaux_tc, cfg.num_experts, cfg.top_k_experts, cfg.moe_groups, cfg.moe_topk_groups) == (
        True, 8, 2, 2, 1)
    assert cfg.routed_scaling_factor == 2.5 and cfg.norm_topk_prob
    assert "layers.0.gate.weight" in weights and "layers.0.router.weight" not in weights  # the first layer is dense
    assert weights["layers.1.router.correction_bias"] is model.layers[1].mlp.gate.e_score_correction_bias
    for name in ("q_a", "q_b", "kv_a", "embed_q", "unembed_out", "shared.gate", "experts.down"):
        assert f"layers.1.{name}.weight" in weights
    cfg, weights, _ = graph_spec(model_of("deepseek_v3_yarn"), policy=unfused)
    assert cfg.ropes[0].base is None and cfg.ropes[0].mscale == 1.0  # YaRN's table (mscale == mscale_all_dim)
    mscale = 0.1 * 1.0 * np.log(4.0) + 1.0  # mscale_all_dim 1, factor 4: the softmax scale takes its square
    assert cfg.attn_scale == pytest.approx((16 + 8) ** -0.5 * mscale**2, rel=1e-6)
    cfg, weights, _ = graph_spec(model_of("deepseek_v3_no_q_lora_tied"), policy=unfused)
    assert "layers.0.q.weight" in weights and "layers.0.q_a.weight" not in weights and "lm_head.weight" not in weights
    assert (cfg.moe_groups, cfg.norm_topk_prob) == (1, False)


@pytest.mark.parametrize("cpu_kernels", KERNELS, ids=["stock", "cpu"][:len(KERNELS)])
@pytest.mark.parametrize("compile_", [True, False], ids=["compiled", "graph"])
@pytest.mark.parametrize("name", NAMES)
def test_plain_step_matches_eager(name, compile_, cpu_kernels):
    assert_plain_matches(model_of(name, cpu_kernels), compile_, f"{name} cpu_kernels={cpu_kernels}")


@pytest.mark.parametrize("name", NAMES)
def test_paged_step_matches_eager_on_the_gather_path(name):
    assert_paged_matches(model_of(name), name)


def test_fused_dense_mlp_matches_eager():
    """The GPU default (fuse_projections): the dense layer's gate|up run as one product, fused in place."""
    model = load_model(hf_setup("deepseek_v3")[0], cpu_kernels=False).model  # fused in place: its own load
    want, want_logits = run_plain(model, None, None)
    step = CompiledDecodeStep(model, policy=DecodePolicy(compile_min_batch=1, fuse_projections=True))
    assert step.fused_projections
    got, got_logits = run_plain(model, None, step)
    assert step.failures == 0 and got == want and max_diff(got_logits, want_logits) <= ATOL


def test_quantized_multi_linear_plain_and_paged():
    """4-bit everything the model quantizes: linears, experts, embedding and the per-head QuantizedMultiLinear."""
    model = quantized_own_model()
    attn = model.layers[1].self_attn
    assert isinstance(attn.embed_q, QuantizedMultiLinear) and isinstance(attn.unembed_out, QuantizedMultiLinear)
    _, _, quant = graph_spec(model)
    assert quant["layers.1.embed_q"] == (32, 4, "affine") and "layers.1.experts.gate" in quant
    for compile_ in (True, False):
        assert_plain_matches(model, compile_, "own 4-bit")
    assert_paged_matches(model, "own 4-bit")


def test_steps_follow_the_correction_bias():
    """The selection-only bias, shifted, picks other experts (the eager logits move far); both steps still match."""
    base, shifted = model_of("deepseek_v3"), load_model(hf_setup("deepseek_v3")[0], cpu_kernels=False).model
    for i, layer in enumerate(shifted.layers[1:]):
        gate = layer.mlp.gate
        gate.e_score_correction_bias = gate.e_score_correction_bias + mx.random.normal(
            gate.e_score_correction_bias.shape, key=mx.random.key(i))
    mx.eval(shifted.parameters())
    forced = mx.random.randint(3, 300, (STEPS,), key=mx.random.key(3)).astype(mx.uint32)
    _, want_base = run_plain(base, forced, None)
    _, want = run_plain(shifted, forced, None)
    assert max_diff(want, want_base) > MOVED_MIN
    _, got = run_plain(shifted, forced, CompiledDecodeStep(shifted, policy=DecodePolicy(compile_min_batch=1)))
    assert max_diff(got, want) <= ATOL
    assert_paged_matches(shifted, "shifted bias")


def test_prompt_chunks_in_the_compiled_paged_step():
    """Mixed steps: a joining request's prompt chunks are rows of the compiled paged step (each row one query
    through its table); the tokens equal the separate-prefill engine's and the plain model's."""
    from test_mixed_steps import PROMPTS, greedy, run

    loaded = load_model(hf_setup("deepseek_v3")[0], cpu_kernels=False)
    mixed, engine = run(loaded, True)
    assert engine.paged_decode is not None and engine.mixed_steps >= 3 and engine.paged_decode.failures == 0
    assert engine.paged_decode.attention_backend == "gather"
    separate, other = run(loaded, False)
    assert other.mixed_steps == 0
    assert mixed == separate
    assert mixed[1] == greedy(loaded.model, PROMPTS[1], 12)


def test_bfloat16_plain_step_matches_eager():
    model = load_model(hf_setup("deepseek_v3")[0], dtype="bfloat16", cpu_kernels=False).model
    assert model.layers[1].self_attn.kv_a_proj_with_mqa.weight.dtype == mx.bfloat16
    want, want_logits = run_plain(model, None, None)
    step = CompiledDecodeStep(model, policy=DecodePolicy(compile_min_batch=1))
    got, got_logits = run_plain(model, None, step)
    diff = max_diff(got_logits, want_logits)
    print(f"deepseek_v3 bfloat16: {diff:.2e}")
    assert step.failures == 0 and diff <= BF16_ATOL
    assert got[:8] == want[:8]


def test_tensor_parallel_graph_is_refused(monkeypatch):
    import mlx_infer.parallel.layers as layers

    model = model_of("deepseek_v3")
    monkeypatch.setattr(layers, "tensor_parallel_of", lambda m: object())
    with pytest.raises(DecodeStepUnsupported, match=r"tensor-parallel DeepSeek V3"):
        graph_spec(model)


def test_every_parameter_is_handed_over():
    """Each variant's parameters all reach the step (graph_spec's check) and the step reads every name."""
    from mlx_infer import _fast

    for model in [model_of(n) for n in NAMES] + [quantized_own_model()]:
        cfg, weights, quant = graph_spec(model, policy=DecodePolicy(fuse_projections=False))  # no fused views
        used = {id(a) for a in weights.values()}
        assert all(id(a) in used for _, a in tree_flatten(model.parameters()))
        _fast.DecodeStep(cfg, weights, quant)


def test_latent_attention_config_out_of_range_is_refused_by_name():
    from mlx_infer import _fast

    cfg, weights, quant = graph_spec(model_of("deepseek_v3"))
    cfg.head_dim = 16  # K must be the latent's width
    with pytest.raises(ValueError, match=r"num_kv_heads must be 1 and head_dim kv_lora_rank \(32\)"):
        _fast.DecodeStep(cfg, weights, quant)
    cfg, weights, quant = graph_spec(model_of("deepseek_v3"))
    cfg.moe_topk_groups = 3  # more groups kept than there are
    with pytest.raises(ValueError, match=r"moe_topk_groups <= moe_groups"):
        _fast.DecodeStep(cfg, weights, quant)
