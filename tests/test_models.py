"""Model graphs and plain KV caches against transformers and mlx-lm (tiny random configs, CPU, float32).

Oracles and tolerances (see DESIGN.md, "Correctness oracles"):

- transformers (torch float32, eager attention), full-sequence logits: ``|ours - hf| <= HF_ATOL``
  elementwise, for a whole prompt and for every cached step (prefill longer
  than the sliding window, single-token decode past the window, a multi-token
  chunk after decode). Every HF tensor is perturbed first (HF zero-initializes
  biases and sets norms to 1), so biases and norm weights matter. Measured max
  |diff| 9e-7 (llama) to 1.7e-6 (gemma3), logits of magnitude about 2; the
  features checked move logits by far more than HF_ATOL (dropping the sliding
  window: 1.6-2.0, llama3 scaling: 0.13, yarn: 0.73, Gemma global linear scaling: 0.41,
  Qwen 2 q bias: 0.03, Qwen 3 q/k norm: 0.98).
- mlx-lm 0.32.2 with the same weights and its own caches: bit-identical
  (``mx.array_equal``) for every family, full prompt and every cached step,
  including decode and chunks past the sliding window; the one exception is
  Mistral past its window, where mlx-lm ignores ``sliding_window`` (checked
  only while the sequence fits the window).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from families import SCHEDULE, SEQ, WINDOW, check_hidden_phase_split, run_schedule  # shared with the family tests
from mlx_infer.contracts import Cache, GraphDeclaration
from mlx_infer.errors import UnsupportedModelError
from mlx_infer.layers.attention import create_attention_mask, create_causal_mask, scaled_dot_product_attention
from mlx_infer.layers.rope import initialize_rope
from mlx_infer.models import MODEL_TYPE_ALIASES, SUPPORTED_MODEL_TYPES, get_model_classes, graph_family
from mlx_infer.state.kv import KVCache, RotatingKVCache

HF_ATOL = 1e-4  # float32 MLX vs float32 torch; measured max |diff| <= 1.7e-6
VOCAB = 256

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-5)


@dataclass
class Family:
    """A tiny config: the HF model that builds it and the mlx-lm module that mirrors it."""

    name: str
    make_config: Callable[[], Any]
    hf_class: Any
    mlx_lm_module: str
    mlx_lm_args: Callable[[dict], dict]  # HF config dict -> mlx-lm ModelArgs dict
    windowed: bool = False  # has sliding-window layers
    mlx_lm_ignores_window: bool = False


def _flat_rope(d: dict) -> dict:
    """mlx-lm's llama/qwen2 read rope_theta/rope_scaling; transformers 5 nests them."""
    rp = d.get("rope_parameters") or {}
    out = dict(d, rope_theta=rp.get("rope_theta", 10000.0))
    if rp.get("rope_type", "default") != "default":
        out["rope_scaling"] = rp
    return out


def _gemma_mlx_lm_args(d: dict) -> dict:
    rp = d["rope_parameters"]
    types = d["layer_types"]
    pattern = types.index("full_attention") + 1
    assert types == ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(len(types))]
    return dict(d, sliding_window_pattern=pattern, rope_theta=rp["full_attention"]["rope_theta"],
                rope_local_base_freq=rp["sliding_attention"]["rope_theta"], rope_scaling=rp["full_attention"])


FAMILIES = {
    f.name: f
    for f in [
        Family("llama", lambda: tf.LlamaConfig(**_SMALL, tie_word_embeddings=False),
               tf.LlamaForCausalLM, "llama", _flat_rope),
        Family("llama3_rope", lambda: tf.LlamaConfig(
            **_SMALL, tie_word_embeddings=True,
            # original context 32 and head_dim 16 put frequencies in all three llama3 bands
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
               tf.LlamaForCausalLM, "llama", _flat_rope),
        Family("mistral", lambda: tf.MistralConfig(**_SMALL, head_dim=16, sliding_window=WINDOW,
                                                   tie_word_embeddings=False),
               tf.MistralForCausalLM, "llama", _flat_rope, windowed=True, mlx_lm_ignores_window=True),
        Family("qwen2", lambda: tf.Qwen2Config(**_SMALL, tie_word_embeddings=True),
               tf.Qwen2ForCausalLM, "qwen2", _flat_rope),
        Family("qwen3", lambda: tf.Qwen3Config(**_SMALL, head_dim=32, tie_word_embeddings=True),
               tf.Qwen3ForCausalLM, "qwen3", lambda d: dict(d, rope_theta=d["rope_parameters"]["rope_theta"])),
        Family("qwen3_yarn", lambda: tf.Qwen3Config(
            **_SMALL, head_dim=32, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32}),
               tf.Qwen3ForCausalLM, "qwen3", lambda d: dict(d, rope_theta=d["rope_parameters"]["rope_theta"])),
        Family("gemma3", lambda: tf.Gemma3TextConfig(
            **{**_SMALL, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
               tf.Gemma3ForCausalLM, "gemma3_text", _gemma_mlx_lm_args, windowed=True),
    ]
}


def _to_mx(state_dict: dict[str, torch.Tensor]) -> dict[str, mx.array]:
    return {k: mx.array(v.detach().float().numpy()) for k, v in state_dict.items()}


def _perturb(module: torch.nn.Module) -> None:
    """HF initializes biases to 0 and norms to 1 (Gemma: 0); perturb every tensor so they all matter."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)


@functools.lru_cache(maxsize=None)
def hf_setup(name: str):
    """(config dict, HF model, weights as mx float32, token ids (2, SEQ), HF logits (2, SEQ, V))."""
    fam = FAMILIES[name]
    torch.manual_seed(0)
    config = fam.make_config()
    config._attn_implementation = "eager"
    hf = fam.hf_class(config).eval()
    _perturb(hf)
    ids = np.random.RandomState(1).randint(0, VOCAB, size=(2, SEQ)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    return config.to_dict(), hf, _to_mx(hf.state_dict()), ids, ref


def build_ours(name: str):
    cfg, _, weights, _, _ = hf_setup(name)
    model_cls, args_cls = get_model_classes(cfg["model_type"])
    model = model_cls(args_cls.from_dict(cfg))
    model.load_weights(list(model.sanitize(dict(weights)).items()), strict=True)
    mx.eval(model.parameters())
    return model


def build_mlx_lm(name: str):
    from mlx_lm.models.cache import make_prompt_cache

    fam = FAMILIES[name]
    cfg, _, weights, _, _ = hf_setup(name)
    mod = importlib.import_module(f"mlx_lm.models.{fam.mlx_lm_module}")
    model = mod.Model(mod.ModelArgs.from_dict(fam.mlx_lm_args(cfg)))
    weights = dict(weights)
    if cfg.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)  # as tied checkpoints are saved
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model, lambda: make_prompt_cache(model)


ALL = list(FAMILIES)


# -- registry -------------------------------------------------------------


def test_registry_aliases_and_unknown_type():
    assert set(SUPPORTED_MODEL_TYPES) >= {"llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text"}
    for t in ("llama", "mistral", "qwen2", "qwen3"):
        assert MODEL_TYPE_ALIASES[t] == "llama"
        assert get_model_classes(t)[0].__module__ == "mlx_infer.models.llama"
    for t in ("gemma3", "gemma3_text"):
        assert get_model_classes(t)[0].__module__ == "mlx_infer.models.gemma3"
    with pytest.raises(UnsupportedModelError, match=r"'mamba'.*gemma3.*qwen3"):
        get_model_classes("mamba")
    assert issubclass(UnsupportedModelError, ValueError)


def test_every_registered_family_declares_itself():
    for model_type, family in MODEL_TYPE_ALIASES.items():
        cls = get_model_classes(model_type)[0]
        assert "family" in vars(cls), f"{cls.__module__}.Model inherits its family instead of declaring it"
        assert graph_family(cls) == cls.family == family, model_type
    llama_cls = get_model_classes("llama")[0]
    recast = type("Model", (llama_cls,), {"__module__": "somewhere.else"})  # a wrapper's re-class
    assert graph_family(recast) == "llama"  # declared, never read from __module__


def test_an_undeclared_graph_is_refused_naming_the_class_and_the_fix():
    from mlx_infer.generation.bindings.autoregressive import bind_autoregressive

    class Undeclared(nn.Module):
        declaration = GraphDeclaration()

    fix = r"test_models\.test_an_undeclared.*\.Undeclared declares no model family; add a class attribute such as `family = \"llama\"`"
    with pytest.raises(UnsupportedModelError, match=fix):
        graph_family(Undeclared())
    with pytest.raises(UnsupportedModelError, match=fix):
        bind_autoregressive(Undeclared())
    Undeclared.family = ""
    with pytest.raises(UnsupportedModelError, match="declares no model family"):
        graph_family(Undeclared)


@pytest.mark.parametrize("name", ALL)
def test_model_args_ignore_unknown_keys_and_declaration(name):
    cfg = hf_setup(name)[0]
    _, args_cls = get_model_classes(cfg["model_type"])
    args = args_cls.from_dict({**cfg, "some_future_key": 1})
    assert args.hidden_size == 64
    model = build_ours(name)
    assert model.declaration == GraphDeclaration(method="autoregressive", compiled_decode=True)
    assert model.args is not None and len(model.layers) == cfg["num_hidden_layers"]
    assert graph_family(model) == MODEL_TYPE_ALIASES[cfg["model_type"]]
    attn = model.layers[0].self_attn  # the Graph members the paged store and the prefill policy size from
    assert all(isinstance(getattr(attn, k), int) for k in ("n_heads", "n_kv_heads", "head_dim"))


# -- against transformers -------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_full_prompt_matches_transformers(name):
    _, _, _, ids, ref = hf_setup(name)
    ours = np.array(build_ours(name)(mx.array(ids)))  # (2, SEQ, V), SEQ > window
    np.testing.assert_allclose(ours, ref, rtol=0, atol=HF_ATOL)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("name", ALL)
def test_cached_steps_match_transformers(name):
    _, _, _, ids, ref = hf_setup(name)
    model = build_ours(name)
    cache = model.make_cache()
    pos = 0
    for n, logits in zip(SCHEDULE, run_schedule(model, cache, mx.array(ids))):
        np.testing.assert_allclose(np.array(logits), ref[:, pos : pos + n], rtol=0, atol=HF_ATOL,
                                   err_msg=f"{name}: chunk at {pos}..{pos + n}")
        pos += n
    assert all(c.offset == SEQ for c in cache)


@pytest.mark.parametrize("name", ALL)
def test_hidden_phase_split_and_input_embeddings(name):
    _, _, _, ids, _ = hf_setup(name)
    check_hidden_phase_split(build_ours(name), ids)


def test_gemma3_multimodal_config_and_weights():
    """The multimodal gemma3 layout (text_config, model.language_model.*, vision tower) loads as text."""
    text_cfg = FAMILIES["gemma3"].make_config()
    vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=28, patch_size=14)
    config = tf.Gemma3Config(text_config=text_cfg.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = tf.Gemma3ForConditionalGeneration(config).eval()
    _perturb(hf)
    ids = np.random.RandomState(2).randint(0, VOCAB, size=(1, 16))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.float().numpy()
    cfg = config.to_dict()
    model_cls, args_cls = get_model_classes(cfg["model_type"])
    args = args_cls.from_dict(cfg)
    assert (args.vocab_size, args.sliding_window, args.num_key_value_heads) == (VOCAB, WINDOW, 2)
    assert args.rope_scaling["rope_type"] == "linear" and args.rope_local_base_freq == 1e4
    weights = _to_mx(hf.state_dict())
    assert any(k.startswith("model.vision_tower.") for k in weights)
    model = model_cls(args)
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    np.testing.assert_allclose(np.array(model(mx.array(ids))), ref, rtol=0, atol=HF_ATOL)
    # The older / mlx-community layout: language_model.model.* and language_model.lm_head.*
    renamed = {
        k.replace("model.language_model.", "language_model.model.").replace("lm_head.", "language_model.lm_head."): v
        for k, v in weights.items()
    }
    model2 = model_cls(args_cls.from_dict(cfg))
    model2.load_weights(list(model2.sanitize(renamed).items()), strict=True)
    assert mx.array_equal(model2(mx.array(ids)), model(mx.array(ids)))


# -- against mlx-lm -------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_full_prompt_bit_identical_to_mlx_lm(name):
    _, _, _, ids, _ = hf_setup(name)
    ours, (theirs, _) = build_ours(name), build_mlx_lm(name)
    short = mx.array(ids[:, :WINDOW - 2])  # shorter than the window: same mask path everywhere
    assert mx.array_equal(ours(short), theirs(short))
    if not FAMILIES[name].mlx_lm_ignores_window:
        full = mx.array(ids)  # longer than the window: array masks
        assert mx.array_equal(ours(full), theirs(full))


@pytest.mark.parametrize("name", ALL)
def test_cached_steps_bit_identical_to_mlx_lm(name):
    _, _, _, ids, _ = hf_setup(name)
    fam = FAMILIES[name]
    ours, (theirs, make_theirs) = build_ours(name), build_mlx_lm(name)
    x = mx.array(ids)
    if fam.mlx_lm_ignores_window:
        schedule = (4, 1, 1, 2)  # stays within the window, where the two models agree
    else:
        schedule = SCHEDULE
    a = run_schedule(ours, ours.make_cache(), x, schedule)
    b = run_schedule(theirs, make_theirs(), x, schedule)
    for i, (la, lb) in enumerate(zip(a, b)):
        assert mx.array_equal(la, lb), f"{name}: step {i} differs by {mx.abs(la - lb).max().item()}"


@pytest.mark.parametrize("kind", ["default", "linear", "llama3", "yarn"])
def test_rope_bit_identical_to_mlx_lm(kind):
    from mlx_lm.models.rope_utils import initialize_rope as mlx_lm_rope

    scaling = {
        "default": None,
        "linear": {"rope_type": "linear", "factor": 4.0},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                 "beta_fast": 32, "beta_slow": 1},
    }[kind]
    x = mx.random.normal((1, 2, 7, 32), key=mx.random.key(0))
    ours = initialize_rope(32, 10000.0, False, scaling, 256)
    theirs = mlx_lm_rope(32, 10000.0, False, scaling, 256)
    for offset in (0, 5, 300):
        assert mx.array_equal(ours(x, offset=offset), theirs(x, offset=offset))
    with pytest.raises(UnsupportedModelError, match="mrope"):
        initialize_rope(32, 10000.0, False, {"rope_type": "mrope"})


# -- caches -----------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_make_cache_types(name):
    model = build_ours(name)
    caches = model.make_cache()
    cfg = hf_setup(name)[0]
    expected = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    if name == "mistral":
        expected = ["sliding_attention"] * cfg["num_hidden_layers"]
    for c, t in zip(caches, expected, strict=True):
        assert isinstance(c, Cache)
        if t == "sliding_attention":
            assert type(c) is RotatingKVCache and c.max_size == WINDOW
        else:
            assert type(c) is KVCache


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_rotating_cache_memory_bound_in_model(name):
    _, _, _, ids, _ = hf_setup(name)
    model = build_ours(name)
    cache = model.make_cache()
    pos = 0
    for n in SCHEDULE:
        mx.eval(model(mx.array(ids[:, pos : pos + n]), cache=cache))
        pos += n
        for c in cache:
            if isinstance(c, RotatingKVCache):
                held = c.keys.shape[2]
                # at most the window, plus the chunk just attended (window - 1 + chunk)
                assert held <= max(WINDOW, WINDOW - 1 + n, n), (pos, n, held)
                if n == 1:
                    assert held <= WINDOW
                assert c.size() == min(pos, WINDOW)


def _reference_attention(q, k, v, q_start, window):
    """Attention of queries at q_start.. over all keys 0..q_end, windowed; no cache."""
    N = q.shape[2]
    mask = create_causal_mask(N, q_start, window)  # (N, q_start + N)
    return scaled_dot_product_attention(q, k[..., : q_start + N, :], v[..., : q_start + N, :], scale=0.5, mask=mask)


@settings(max_examples=40, deadline=None)
@given(
    max_size=st.integers(1, 9),
    extra=st.integers(0, 3),  # window_size = max_size - extra (narrower window than buffer)
    chunks=st.lists(st.integers(1, 12), min_size=1, max_size=8),
)
def test_rotating_cache_attention_equals_windowed_reference(max_size, extra, chunks):
    window = max(1, max_size - extra)
    T = sum(chunks)
    key = mx.random.key(sum(chunks) * 31 + max_size)
    kq, kk, kv = mx.random.split(key, 3)
    q = mx.random.normal((1, 2, T, 4), key=kq)
    k = mx.random.normal((1, 2, T, 4), key=kk)
    v = mx.random.normal((1, 2, T, 4), key=kv)
    cache = RotatingKVCache(max_size)
    pos = 0
    for n in chunks:
        mask = cache.make_mask(n, window_size=window)
        keys, values = cache.update_and_fetch(k[..., pos : pos + n, :], v[..., pos : pos + n, :])
        assert keys.shape[2] <= max(max_size, max_size - 1 + n)
        out = scaled_dot_product_attention(q[..., pos : pos + n, :], keys, values, scale=0.5, mask=mask)
        ref = _reference_attention(q[..., pos : pos + n, :], k, v, pos, window)
        assert mx.allclose(out, ref, atol=1e-5).item(), (pos, n)
        pos += n
        assert cache.offset == pos and cache.size() == min(pos, max_size)


def test_kv_cache_growth_trim_state_and_masks():
    cache = KVCache()
    assert isinstance(cache, Cache) and cache.nbytes == 0 and cache.state == ()
    assert cache.make_mask(1) is None and cache.make_mask(4) == "causal"
    k = mx.ones((1, 2, 300, 8))
    keys, _ = cache.update_and_fetch(k[..., :10, :], k[..., :10, :])
    assert keys.shape[2] == 10 and cache.keys.shape[2] == 256
    cache.update_and_fetch(k[..., 10:, :], k[..., 10:, :])
    # growth drops the unused tail (10 written of 256) and appends whole steps for the 290 new
    assert cache.offset == 300 and cache.keys.shape[2] == 10 + 512
    assert cache.nbytes == 2 * 522 * 2 * 8 * 4
    assert cache.trim(5) == 5 and cache.offset == 295 and cache.is_trimmable()
    assert cache.make_mask(3, return_array=True).shape == (3, 298)
    assert cache.make_mask(1, window_size=4).shape == (1, 296)
    restored = KVCache.from_state(cache.state, cache.meta_state)
    assert restored.offset == 295 and mx.array_equal(restored.state[0], cache.state[0])


def test_rotating_cache_trim_and_state():
    cache = RotatingKVCache(8)
    assert isinstance(cache, Cache)
    x = mx.arange(6, dtype=mx.float32).reshape(1, 1, 6, 1)
    cache.update_and_fetch(x, -x)
    assert cache.is_trimmable() and cache.trim(2) == 2 and cache.offset == 4
    keys, values = cache.update_and_fetch(x[..., :1, :] + 100, x[..., :1, :] - 100)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 100]
    assert values[0, 0, :, 0].tolist() == [0, -1, -2, -3, -100]
    for i in range(5):
        cache.update_and_fetch(x[..., :1, :] + i, x[..., :1, :] - i)
    assert cache.offset == 10 and not cache.is_trimmable() and cache.trim(1) == 0
    restored = RotatingKVCache.from_state(cache.state, cache.meta_state)
    assert (restored.offset, restored.max_size, restored.size()) == (10, 8, 8)
    assert mx.array_equal(restored.state[0], cache.state[0])


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_trim_then_continue_matches_transformers(name):
    """Prefill, drop the last tokens (speculative rollback), re-feed them: same logits as HF."""
    _, _, _, ids, ref = hf_setup(name)
    model = build_ours(name)
    cache = model.make_cache()
    x = mx.array(ids)
    mx.eval(model(x[:, :6], cache=cache))  # 6 < window: every cache is still trimmable
    assert all(c.is_trimmable() for c in cache)
    assert [c.trim(2) for c in cache] == [2] * len(cache)
    logits = model(x[:, 4:7], cache=cache)
    np.testing.assert_allclose(np.array(logits), ref[:, 4:7], rtol=0, atol=HF_ATOL)


def test_create_attention_mask_without_cache():
    h = mx.zeros((1, 5, 4))
    assert create_attention_mask(h[:, :1]) is None
    assert create_attention_mask(h) == "causal"
    assert create_attention_mask(h, window_size=8) == "causal"
    m = create_attention_mask(h, window_size=2)
    assert m.tolist()[4] == [False, False, False, True, True]
    assert create_attention_mask(h, return_array=True).shape == (5, 5)
