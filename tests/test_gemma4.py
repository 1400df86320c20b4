"""Gemma 4 text graph against transformers and mlx-lm (tiny random configs, CPU, float32).

One tiny config per switch (window 8, prompt 16 > window, then 16 single-token
decode steps with our caches; every config has full layers with their own head
dim and proportional partial RoPE, q/k/v norms, scale-1 attention, GeGLU,
scaled embeddings and soft-capped logits):

- ``dense``      untied head, k_eq_v off
- ``k_eq_v``     full layers: V = K's projection, 1 global KV head
- ``ple``        per-layer inputs (embed_tokens_per_layer + projection + gates)
- ``kv_shared``  6 layers, the last 2 read their donors' K/V; double-wide MLP; per-layer inputs
- ``moe``        router top-2 of 4 experts beside the dense MLP; k_eq_v on

Oracles and tolerances (see DESIGN.md, "Correctness oracles"):

- transformers 5.24 ``Gemma4ForCausalLM`` (torch float32, eager attention), every
  tensor and buffer perturbed (norms, layer scalars, router scales by 0.3,
  matrices by 0.05): ``|ours - hf| <= HF_ATOL`` elementwise and equal greedy
  tokens, for the whole prompt and for every cached step. Measured max |diff|
  (logits of magnitude ~2): dense 1.4e-5, k_eq_v 4.5e-5, ple 6.0e-6,
  kv_shared 4.1e-5, moe 8.3e-6; the multimodal checkpoint 5.4e-6. Scale-1
  attention over unit-RMS q/k makes the softmax sharp, so float32 rounding
  differences grow more than in Gemma 3.
- mlx-lm 0.32.2 ``gemma4_text`` with the same weights and its own caches:
  bit-identical (``mx.array_equal``) for every config, full prompt and every
  cached step, in float32 and (k_eq_v, kv_shared) bfloat16; MLX-quantized checkpoints (affine and mxfp4, 8-bit router, experts
  through ``gather_qmm``) written by mlx-lm's ``gemma4`` wrapper and loaded through
  our loader: bit-identical too.
- Each feature moves logits by far more than HF_ATOL (``test_features_matter``).
"""

from __future__ import annotations

import copy
import functools
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers as tf

from families import check_hidden_phase_split
from mlx_infer.contracts import GraphDeclaration
from mlx_infer.errors import UnsupportedModelError
from mlx_infer.models import MODEL_TYPE_ALIASES, get_model_classes
from mlx_infer.state.kv import KVCache, RotatingKVCache, cache_nbytes

HF_ATOL = 2e-4  # float32 MLX vs float32 torch; measured max |diff| <= 4.5e-5
WINDOW, VOCAB = 8, 256
PROMPT, STEPS = 16, 16  # prefill longer than the window, then single-token decode
SEQ = PROMPT + STEPS
S, F = "sliding_attention", "full_attention"

_BASE = dict(
    vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=WINDOW,
    final_logit_softcapping=30.0, hidden_size_per_layer_input=0, max_position_embeddings=256,
    rope_parameters={S: {"rope_type": "default", "rope_theta": 10_000.0},
                     F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}},
)
_K_EQ_V = dict(attention_k_eq_v=True, num_global_key_value_heads=1)
CONFIGS = {
    "dense": dict(num_hidden_layers=4, layer_types=[S, S, F, F], tie_word_embeddings=False),
    "k_eq_v": dict(num_hidden_layers=3, layer_types=[S, S, F], **_K_EQ_V),
    "ple": dict(num_hidden_layers=3, layer_types=[S, S, F], hidden_size_per_layer_input=8),
    "kv_shared": dict(num_hidden_layers=6, layer_types=[S, S, F, S, S, F], hidden_size_per_layer_input=8,
                      num_kv_shared_layers=2, use_double_wide_mlp=True),
    "moe": dict(num_hidden_layers=3, layer_types=[S, S, F], enable_moe_block=True, num_experts=4,
                top_k_experts=2, moe_intermediate_size=32, **_K_EQ_V),
}
ALL = list(CONFIGS)


def _to_mx(state_dict: dict[str, torch.Tensor]) -> dict[str, mx.array]:
    return {k: mx.array(v.detach().float().numpy()) for k, v in state_dict.items()}


def _perturb(module: torch.nn.Module) -> None:
    """HF sets norms, router scales and layer scalars to 1: move every tensor so each one matters."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name or "embed_scale" in name:
                continue
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim <= 1 else 0.05))


@functools.lru_cache(maxsize=None)
def hf_setup(name: str):
    """(HF config dict, weights as mx float32, token ids (2, SEQ), HF full-sequence logits (2, SEQ, V))."""
    torch.manual_seed(0)
    config = tf.Gemma4TextConfig(**{**_BASE, **CONFIGS[name]})
    config._attn_implementation = "eager"
    hf = tf.Gemma4ForCausalLM(config).eval()
    _perturb(hf)
    ids = np.random.RandomState(1).randint(0, VOCAB, size=(2, SEQ)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    return config.to_dict(), _to_mx(hf.state_dict()), ids, ref


def build_ours(name: str, **overrides):
    cfg, weights, _, _ = hf_setup(name)
    model_cls, args_cls = get_model_classes(cfg["model_type"])
    model = model_cls(args_cls.from_dict({**cfg, **overrides}))
    model.load_weights(list(model.sanitize(dict(weights)).items()), strict=True)
    mx.eval(model.parameters())
    return model


def build_mlx_lm(name: str):
    from mlx_lm.models import gemma4_text

    cfg, weights, _, _ = hf_setup(name)
    # transformers 5.24 writes per_layer_config; mlx-lm reads the global_* keys.
    extra = {k: {**_BASE, **CONFIGS[name]}.get(k) for k in ("global_head_dim", "num_global_key_value_heads")}
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict({**cfg, **extra}))
    weights = dict(weights)
    if cfg["tie_word_embeddings"]:
        weights.pop("lm_head.weight")
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def run_cached(model, cache, ids: mx.array, schedule=(PROMPT,) + (1,) * STEPS) -> list[mx.array]:
    """Feed ``ids`` in chunks through ``cache``; return each chunk's logits (B, chunk, V)."""
    outs, pos = [], 0
    for n in schedule:
        outs.append(model(ids[:, pos : pos + n], cache=cache))
        mx.eval(outs[-1])
        pos += n
    return outs


# -- config ------------------------------------------------------------------


def test_registry_args_and_declaration():
    assert MODEL_TYPE_ALIASES["gemma4"] == MODEL_TYPE_ALIASES["gemma4_text"] == "gemma4"
    cfg = hf_setup("moe")[0]
    model_cls, args_cls = get_model_classes("gemma4_text")
    assert get_model_classes("gemma4")[0] is model_cls
    args = args_cls.from_dict({**cfg, "some_future_key": 1})
    assert (args.layer_head_dims, args.layer_kv_heads, args.kv_donors) == ([16, 16, 32], [2, 2, 1], [None] * 3)
    # The global_* keys (as Google's config.json has them) give the same layout as per_layer_config.
    flat = {k: v for k, v in cfg.items() if k != "per_layer_config"}
    args2 = args_cls.from_dict({**flat, "global_head_dim": 32, "num_global_key_value_heads": 1})
    assert (args2.layer_head_dims, args2.layer_kv_heads) == (args.layer_head_dims, args.layer_kv_heads)
    shared = args_cls.from_dict(hf_setup("kv_shared")[0])
    assert shared.kv_donors == [None, None, None, None, 3, 2]
    assert model_cls.declaration == GraphDeclaration(method="autoregressive", compiled_decode=True)


def test_unsupported_configs_raise():
    _, args_cls = get_model_classes("gemma4_text")
    base = {**_BASE, "model_type": "gemma4_text", "num_hidden_layers": 2, "layer_types": [S, F]}
    with pytest.raises(UnsupportedModelError, match="num_kv_shared_layers"):
        args_cls.from_dict({**base, "num_kv_shared_layers": 2})
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        args_cls.from_dict({**base, "use_bidirectional_attention": "all"})
    with pytest.raises(ValueError, match="no earlier full_attention"):
        args_cls.from_dict({**base, "num_hidden_layers": 3, "layer_types": [S, S, F], "num_kv_shared_layers": 1})
    with pytest.raises(ValueError, match="num_experts"):
        args_cls.from_dict({**base, "enable_moe_block": True})


# -- against transformers ------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_full_prompt_matches_transformers(name):
    _, _, ids, ref = hf_setup(name)
    ours = np.array(build_ours(name)(mx.array(ids)))  # (2, SEQ, V)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=HF_ATOL)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("name", ALL)
def test_prefill_and_decode_match_transformers(name):
    _, _, ids, ref = hf_setup(name)
    model = build_ours(name)
    cache = model.make_cache()
    pos = 0
    for logits in run_cached(model, cache, mx.array(ids)):
        n = logits.shape[1]
        got = np.array(logits)
        np.testing.assert_allclose(got, ref[:, pos : pos + n], rtol=0, atol=HF_ATOL, err_msg=f"{name} at {pos}")
        assert (got.argmax(-1) == ref[:, pos : pos + n].argmax(-1)).all()
        pos += n
    assert all(c.offset == SEQ for c in cache)


@pytest.mark.parametrize("name", ["kv_shared", "moe"])
def test_chunk_after_decode_matches_transformers(name):
    """A multi-token chunk once the rotating caches have wrapped (their chunk path)."""
    _, _, ids, ref = hf_setup(name)
    model = build_ours(name)
    outs = run_cached(model, model.make_cache(), mx.array(ids), (12, 1, 1, 6, 1, 1, 1, 9))
    np.testing.assert_allclose(np.concatenate([np.array(o) for o in outs], 1), ref, rtol=0, atol=HF_ATOL)


# -- against mlx-lm --------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_bit_identical_to_mlx_lm(name):
    _, _, ids, _ = hf_setup(name)
    ours, theirs = build_ours(name), build_mlx_lm(name)
    x = mx.array(ids)
    assert mx.array_equal(ours(x), theirs(x))
    a = run_cached(ours, ours.make_cache(), x)
    b = run_cached(theirs, theirs.make_cache(), x)
    for i, (la, lb) in enumerate(zip(a, b, strict=True)):
        assert mx.array_equal(la, lb), f"{name}: step {i} differs by {mx.abs(la - lb).max().item()}"


@pytest.mark.parametrize("name", ["k_eq_v", "kv_shared"])
def test_bfloat16_bit_identical_to_mlx_lm(name):
    """bf16 weights and activations (MLX's CPU gather_mm is float32-only, so the unquantized MoE is left out)."""
    _, _, ids, _ = hf_setup(name)
    ours, theirs = build_ours(name), build_mlx_lm(name)
    for m in (ours, theirs):
        m.set_dtype(mx.bfloat16)
    a = run_cached(ours, ours.make_cache(), mx.array(ids))
    b = run_cached(theirs, theirs.make_cache(), mx.array(ids))
    assert a[0].dtype == mx.bfloat16
    assert all(mx.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_mlx_quantized_wrapper_checkpoint_loads_bit_identical(tmp_path, mode):
    """An mlx-lm-quantized multimodal-wrapper checkpoint (8-bit router keyed by mlx-lm's paths, quantized
    experts) loads through our loader and matches mlx-lm exactly."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma4 as mlx_lm_gemma4
    from mlx_lm.utils import quantize_model
    from tiny import make_tokenizer_json

    from mlx_infer.artifacts.loader import load_model_dir

    text = {**_BASE, **CONFIGS["moe"], "model_type": "gemma4_text", "hidden_size_per_layer_input": 8,
            "num_hidden_layers": 4, "layer_types": [S, F, S, F], "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True}  # stated: mlx-lm defaults it to True, transformers to False
    config = {"model_type": "gemma4", "text_config": text, "vocab_size": VOCAB}
    mx.random.seed(0)
    theirs = mlx_lm_gemma4.Model(mlx_lm_gemma4.ModelArgs.from_dict(copy.deepcopy(config)))
    theirs, qconfig = quantize_model(theirs, copy.deepcopy(config), 32, 4, mode=mode)
    assert qconfig["quantization"]["language_model.model.layers.0.router.proj"]["bits"] == 8
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(theirs.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(qconfig))
    (tmp_path / "tokenizer.json").write_text(make_tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    ours = load_model_dir(tmp_path).model
    layer = ours.layers[0]
    assert (layer.router.proj.bits, layer.experts.switch_glu.up_proj.bits) == (8, 4)
    assert layer.experts.switch_glu.up_proj.mode == mode
    ids = mx.array(np.random.RandomState(3).randint(0, VOCAB, size=(2, 40)))  # 160 routed rows: sorted path
    assert mx.array_equal(ours(ids), theirs(ids))
    a = run_cached(ours, ours.make_cache(), ids, (20, 1, 1, 1))
    b = run_cached(theirs, theirs.make_cache(), ids, (20, 1, 1, 1))
    assert all(mx.array_equal(x, y) for x, y in zip(a, b, strict=True))


# -- caches and KV sharing ---------------------------------------------------------


def test_kv_shared_layers_own_no_cache():
    model = build_ours("kv_shared")  # 6 layers, the last 2 shared
    caches = model.make_cache()
    assert [type(c) for c in caches] == [RotatingKVCache, RotatingKVCache, KVCache, RotatingKVCache]
    assert all(c.max_size == WINDOW for c in caches if isinstance(c, RotatingKVCache))
    for layer in model.layers[4:]:
        assert not hasattr(layer.self_attn, "k_proj") and not hasattr(layer.self_attn, "k_norm")
    # Cache bytes equal those of the donors alone: the same 6 layers with nothing shared hold 6 caches,
    # whose first 4 match ours in bytes and shapes.
    cfg, _, ids, _ = hf_setup("kv_shared")
    model_cls, args_cls = get_model_classes("gemma4_text")
    unshared = model_cls(args_cls.from_dict({**cfg, "num_kv_shared_layers": 0}))  # random weights: only sizes matter
    a, b = model.make_cache(), unshared.make_cache()
    run_cached(model, a, mx.array(ids))
    run_cached(unshared, b, mx.array(ids))
    assert len(b) == 6
    assert cache_nbytes(a) == cache_nbytes(b[:4]) < cache_nbytes(b)
    assert [(x.keys.shape, x.values.shape) for x in a] == [(x.keys.shape, x.values.shape) for x in b[:4]]


# -- structure -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ple", "kv_shared"])
def test_hidden_phase_split_and_input_embeddings(name):
    """``model.model`` gives hidden states; embeddings alone recover the per-layer inputs' token ids."""
    _, _, ids, _ = hf_setup(name)
    model = build_ours(name)
    x, logits = check_hidden_phase_split(model, ids)
    emb = model.model.embed_tokens(x)  # (B, L, hidden)
    pli = model.model.per_layer_inputs(x)  # (B, L, layers, P)
    assert pli.shape == (2, 10, model.args.num_hidden_layers, 8)
    assert mx.array_equal(model(None, input_embeddings=emb, per_layer_inputs=pli), logits)


def _ablate_window(name):
    return build_ours(name, sliding_window=SEQ)


def _ablate(path_fn):
    def run(name):
        model = build_ours(name)
        path_fn(model)
        return model
    return run


def _zero(module):
    module.weight = mx.zeros_like(module.weight)


ABLATIONS = {
    "sliding_window": ("dense", _ablate_window),
    "proportional_rope": ("dense", _ablate(lambda m: [setattr(layer.self_attn, "rope", nn.RoPE(32, base=1e6))
                                                      for layer in m.layers if layer.layer_type == F])),
    "per_layer_inputs": ("ple", _ablate(lambda m: [_zero(layer.per_layer_projection) for layer in m.layers])),
    "experts": ("moe", _ablate(lambda m: [_zero(layer.experts.switch_glu.down_proj) for layer in m.layers])),
    "layer_scalar": ("moe", _ablate(lambda m: [setattr(layer, "layer_scalar", mx.ones((1,))) for layer in m.layers])),
}


@pytest.mark.parametrize("feature", list(ABLATIONS))
def test_features_matter(feature):
    """Removing a feature moves logits by far more than HF_ATOL, so the parity tests check it."""
    name, ablate = ABLATIONS[feature]
    _, _, ids, ref = hf_setup(name)
    moved = np.abs(np.array(ablate(name)(mx.array(ids))) - ref).max()
    assert moved > 100 * HF_ATOL, (feature, moved)


# -- checkpoint layouts ------------------------------------------------------------


def test_multimodal_checkpoint_loads_as_text():
    """Gemma4ForConditionalGeneration (text_config, model.language_model.*, vision and audio towers),
    and the same weights under mlx-lm/mlx-vlm's ``language_model.model.*`` names."""
    text = {**_BASE, **CONFIGS["moe"], "hidden_size_per_layer_input": 8}
    vision = tf.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=8)
    audio = tf.Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=16,
                                 subsampling_conv_channels=[8, 4])
    config = tf.Gemma4Config(text_config=text, vision_config=vision.to_dict(), audio_config=audio.to_dict())
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = tf.Gemma4ForConditionalGeneration(config).eval()
    _perturb(hf)
    ids = np.random.RandomState(2).randint(0, VOCAB, size=(1, 16))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.float().numpy()
    cfg = config.to_dict()
    model_cls, args_cls = get_model_classes(cfg["model_type"])
    weights = _to_mx(hf.state_dict())
    assert any(k.startswith("model.audio_tower.") for k in weights)
    model = model_cls(args_cls.from_dict(cfg))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    np.testing.assert_allclose(np.array(model(mx.array(ids))), ref, rtol=0, atol=HF_ATOL)
    renamed = {k.replace("model.language_model.", "language_model.model.").replace("model.", "", 1)
               if not k.startswith("model.language_model.") else k.replace("model.language_model.",
                                                                            "language_model.model."): v
               for k, v in weights.items()}
    assert "vision_tower.encoder.layers.0.mlp.gate_proj.linear.weight" in renamed
    model2 = model_cls(args_cls.from_dict(cfg))
    model2.load_weights(list(model2.sanitize(renamed).items()), strict=True)
    assert mx.array_equal(model2(mx.array(ids)), model(mx.array(ids)))


@pytest.mark.parametrize("name", ["dense", "kv_shared", "moe"])
def test_generation_loop_drives_gemma4(name):
    """The AR binding binds Gemma 4 (with its compiled step: tests/test_gemma4_decode_step.py) and the loop
    runs it eagerly and through the compiled step, with the same greedy tokens as full-sequence forwards."""
    from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep
    from mlx_infer.generation.autoregressive import generate_tokens
    from mlx_infer.generation.bindings.autoregressive import bind_autoregressive

    model = build_ours(name)
    binding = bind_autoregressive(model)
    assert binding.decode_unavailable_reason() is None
    decode = binding.create_decode()
    assert isinstance(decode, CompiledDecodeStep)
    _, _, ids, _ = hf_setup(name)
    prompt = ids[0].tolist()
    chunk = binding.prefill_policy.chunk_size(len(prompt))
    got = [t.token for t in generate_tokens(model, prompt, max_tokens=6, prefill_step_size=chunk)]
    compiled = [t.token for t in generate_tokens(model, prompt, max_tokens=6, prefill_step_size=chunk,
                                                 decode=decode)]
    assert decode.failures == 0 and compiled == got
    ref = []
    seq = list(prompt)
    for _ in range(6):
        ref.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
        seq.append(ref[-1])
    assert got == ref
