"""Tiny random checkpoints of the families added for issue 20, written by transformers itself.

Each :class:`Spec` builds a transformers config and model (torch, float32, eager attention),
perturbs every tensor (HF zero-initializes biases and sets norms to 1, so they would
not matter otherwise), and saves it with ``save_pretrained`` (safetensors + config.json,
the layout a Hub checkpoint has) plus the tiny tokenizer of tests/tiny.py. The
tests (tests/test_families*.py) load that directory with mlx-infer's loader and with
mlx-lm, and compare against the HF logits computed here.
"""

from __future__ import annotations

import functools
import importlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
import torch
import transformers as tf

from tiny import CHAT_TEMPLATE, make_tokenizer_json

VOCAB = 320
WINDOW = 8  # sliding window of the windowed configs
SEQ = 24  # prompt + continuation of the cached schedule
# Cached schedule: prefill longer than the window, decode past it, a chunk, more decode.
SCHEDULE = (12, 1, 1, 1, 1, 5, 1, 1, 1)
assert sum(SCHEDULE) == SEQ and SCHEDULE[0] > WINDOW

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
             initializer_range=0.1, bos_token_id=0, eos_token_id=1, pad_token_id=2)


@dataclass
class Spec:
    """One tiny config of a family and how its oracles read it.

    Attributes:
        name: test id.
        make_config: the transformers config.
        hf_class: the transformers causal-LM class.
        mlx_lm_module: ``mlx_lm.models.<module>`` mirroring it, or ``None``.
        mlx_lm_args: HF config dict -> mlx-lm ``ModelArgs`` dict (transformers 5 nests RoPE settings).
        windowed: has sliding-window layers (the schedule runs past the window).
        mlx_lm: ``"exact"`` (bit-identical everywhere), ``"in_window"`` (mlx-lm ignores the window:
            bit-identical while the sequence fits it), ``"full_only"`` (bit-identical for a whole
            prompt only; why in ``note``) or ``"none"``.
        note: why a comparison is restricted.
    """

    name: str
    make_config: Callable[[], Any]
    hf_class: Any
    mlx_lm_module: str | None
    mlx_lm_args: Callable[[dict], dict] = lambda d: d
    windowed: bool = False
    mlx_lm: str = "exact"
    note: str = ""
    gguf_arch: str | None = None
    extra: dict = field(default_factory=dict)


def flat_rope(d: dict) -> dict:
    """mlx-lm reads ``rope_theta`` / ``rope_scaling`` at the top level; transformers 5 nests them."""
    rp = d.get("rope_parameters") or {}
    out = dict(d, rope_theta=rp.get("rope_theta", d.get("rope_theta", 10000.0)))
    if rp.get("rope_type", "default") != "default":
        out["rope_scaling"] = dict(rp, type=rp["rope_type"])
    return out


SPECS: dict[str, Spec] = {}


def register(*specs: Spec) -> None:
    for s in specs:
        SPECS[s.name] = s


def _perturb(module: torch.nn.Module, *, embed_scale: float = 1.0, vector_noise: float = 0.05) -> None:
    """Noise on every tensor (``vector_noise`` on 1-D ones); ``embed_scale`` shrinks the embedding
    (a tied, sqrt(hidden)-scaled embedding otherwise makes a random model echo its last token)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.add_(torch.randn_like(p) * (vector_noise if p.ndim == 1 else 0.05))
            if "embed_tokens" in name:
                p.mul_(embed_scale)


def write_tokenizer(path: Path) -> None:
    (path / "tokenizer.json").write_text(make_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))


@functools.lru_cache(maxsize=None)
def hf_setup(name: str) -> tuple[Path, dict, np.ndarray, np.ndarray]:
    """``(checkpoint dir, config dict, token ids (2, SEQ), HF logits (2, SEQ, V))``, once per spec."""
    spec = SPECS[name]
    torch.manual_seed(0)
    config = spec.make_config()
    config._attn_implementation = "eager"
    hf = spec.hf_class(config).eval()
    _perturb(hf, **spec.extra.get("perturb", {}))
    ids = np.random.RandomState(1).randint(3, VOCAB, size=(2, SEQ)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    path = Path(tempfile.mkdtemp(prefix=f"family-{name}-"))
    hf.save_pretrained(path)
    write_tokenizer(path)
    cfg = json.loads((path / "config.json").read_text())
    return path, cfg, ids, ref


def hf_cached_logits(name: str, schedule=SCHEDULE) -> list[np.ndarray]:
    """HF's own cached forward over ``schedule`` (its DynamicCache), per chunk."""
    spec = SPECS[name]
    path, _, ids, _ = hf_setup(name)
    hf = spec.hf_class.from_pretrained(path, attn_implementation="eager").eval()
    out, past, pos = [], None, 0
    with torch.no_grad():
        for n in schedule:
            r = hf(torch.tensor(ids[:, pos:pos + n], dtype=torch.long), cache=past, use_cache=True)
            past = r.past_key_values
            out.append(r.logits.float().numpy())
            pos += n
    return out


def build_ours(name: str, **kw: Any):
    """mlx-infer's load of the saved directory (stock MLX kernels unless told otherwise)."""
    from mlx_infer.artifacts.loader import load_model

    return load_model(hf_setup(name)[0], cpu_kernels=kw.pop("cpu_kernels", False), **kw).model


def build_mlx_lm(name: str):
    """mlx-lm's model of the same weights, and a function making its caches."""
    from mlx_lm.models.cache import make_prompt_cache

    spec = SPECS[name]
    path, cfg, _, _ = hf_setup(name)
    mod = importlib.import_module(f"mlx_lm.models.{spec.mlx_lm_module}")
    model = mod.Model(mod.ModelArgs.from_dict(spec.mlx_lm_args(cfg)))
    weights = mx.load(str(path / "model.safetensors"))
    if spec.extra.get("mlx_lm_reads_our_names"):  # mlx-lm's sanitize reads another layout than transformers'
        from mlx_infer.models import get_model_classes

        ours_cls, ours_args = get_model_classes(cfg["model_type"])
        weights = ours_cls(ours_args.from_dict(cfg)).sanitize(weights)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model, lambda: make_prompt_cache(model)


def run_schedule(model, cache, ids: mx.array, schedule=SCHEDULE) -> list[mx.array]:
    """Feed ``ids`` in chunks; each chunk's logits ``(B, chunk, V)``."""
    outs, pos = [], 0
    for n in schedule:
        logits = model(ids[:, pos:pos + n], cache=cache)
        mx.eval(logits)
        outs.append(logits)
        pos += n
    return outs


def check_hidden_phase_split(model, ids: np.ndarray) -> tuple[mx.array, mx.array]:
    """The graph's two phases and its embedding input agree, exactly, on ``ids[:, :10]``.

    Asserts ``model(x) == model.logits_from_hidden(model.model(x))`` and
    ``model(x) == model(None, input_embeddings=model.model.embed_tokens(x))``;
    returns ``(x (B, 10), logits (B, 10, V))`` for further checks.
    """
    x = mx.array(ids[:, :10])
    logits = model(x)
    assert mx.array_equal(model.logits_from_hidden(model.model(x)), logits)
    emb = model.model.embed_tokens(x)  # (B, L, hidden)
    assert mx.array_equal(model(None, input_embeddings=emb), logits)
    return x, logits


GEMMA_SPREAD = {"perturb": {"embed_scale": 0.3, "vector_noise": 1.0}}

# -- the families ------------------------------------------------------------------------

register(
    Spec("gemma2", lambda: tf.Gemma2Config(
        **{**SMALL, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
         tf.Gemma2ForCausalLM, "gemma2", flat_rope, windowed=True, mlx_lm="in_window",
         note="mlx-lm's gemma2 treats every layer as global", gguf_arch="gemma2", extra=GEMMA_SPREAD),
    Spec("gemma2_untied_global", lambda: tf.Gemma2Config(
        **SMALL, head_dim=32, query_pre_attn_scalar=24, sliding_window=64,
        layer_types=["full_attention"] * 2, attn_logit_softcapping=None, final_logit_softcapping=None,
        tie_word_embeddings=False),
         tf.Gemma2ForCausalLM, None, flat_rope, extra=GEMMA_SPREAD),
)


def _phi3_mlx_lm(d: dict) -> dict:
    out = flat_rope(d)
    rp = d.get("rope_parameters") or {}
    out["partial_rotary_factor"] = rp.get("partial_rotary_factor", 1.0)
    out["original_max_position_embeddings"] = rp.get("original_max_position_embeddings",
                                                     d.get("original_max_position_embeddings", 4096))
    return out


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 2.1, 3.7],
            "long_factor": [1.1, 2.5, 6.0, 14.0], "original_max_position_embeddings": 16,
            "partial_rotary_factor": 0.5}
register(
    Spec("phi3", lambda: tf.Phi3Config(**SMALL, tie_word_embeddings=False), tf.Phi3ForCausalLM, "phi3",
         _phi3_mlx_lm, gguf_arch="phi3"),
    Spec("phi3_longrope_partial", lambda: tf.Phi3Config(
        **{**SMALL, "max_position_embeddings": 64}, tie_word_embeddings=True, original_max_position_embeddings=16,
        rope_parameters=LONGROPE), tf.Phi3ForCausalLM, "phi3", _phi3_mlx_lm, mlx_lm="full_only",
         gguf_arch="phi3", note="mlx-lm's SuScaledRoPE always uses long_factor; transformers (and we) use short_factor while a "
              "call ends within original_max_position_embeddings", extra={"per_call_rope": True}),
    Spec("phi3_sliding", lambda: tf.Phi3Config(**SMALL, sliding_window=WINDOW), tf.Phi3ForCausalLM, "phi3",
         _phi3_mlx_lm, windowed=True, mlx_lm="in_window", note="mlx-lm's phi3 ignores sliding_window"),
)


def _qwen3_moe_mlx_lm(d: dict) -> dict:
    return dict(flat_rope(d), num_experts=d.get("num_experts", d.get("num_local_experts")))


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
register(
    Spec("qwen3_moe", lambda: tf.Qwen3MoeConfig(**SMALL, **MOE, head_dim=32, norm_topk_prob=True,
                                                tie_word_embeddings=False),
         tf.Qwen3MoeForCausalLM, "qwen3_moe", _qwen3_moe_mlx_lm, gguf_arch="qwen3moe"),
    Spec("qwen3_moe_dense_layer_tied", lambda: tf.Qwen3MoeConfig(
        **{**SMALL, "num_hidden_layers": 3}, **MOE, head_dim=16, mlp_only_layers=[1], norm_topk_prob=False,
        tie_word_embeddings=True), tf.Qwen3MoeForCausalLM, "qwen3_moe", _qwen3_moe_mlx_lm),
)

register(
    Spec("olmo2", lambda: tf.Olmo2Config(**SMALL, tie_word_embeddings=False), tf.Olmo2ForCausalLM, "olmo2",
         flat_rope, gguf_arch="olmo2"),
    Spec("olmo2_bias_tied_yarn", lambda: tf.Olmo2Config(
        **SMALL, attention_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32}),
         tf.Olmo2ForCausalLM, "olmo2", flat_rope),
)

GRANITE = dict(embedding_multiplier=3.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=2.0)
register(
    Spec("granite", lambda: tf.GraniteConfig(**SMALL, **GRANITE, tie_word_embeddings=True), tf.GraniteForCausalLM,
         "granite", flat_rope, gguf_arch="granite", extra=GEMMA_SPREAD),
    Spec("granite_untied_bias_llama3", lambda: tf.GraniteConfig(
        **SMALL, **GRANITE, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
         tf.GraniteForCausalLM, "granite", flat_rope),
)

register(
    Spec("smollm3", lambda: tf.SmolLM3Config(**{**SMALL, "num_hidden_layers": 4}, no_rope_layer_interval=4,
                                             tie_word_embeddings=True),
         tf.SmolLM3ForCausalLM, "smollm3", flat_rope, gguf_arch="smollm3"),
    Spec("smollm3_untied_bias_sliding", lambda: tf.SmolLM3Config(
        **{**SMALL, "num_hidden_layers": 3}, no_rope_layers=[1, 0, 1], attention_bias=True,
        tie_word_embeddings=False, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
         tf.SmolLM3ForCausalLM, "smollm3", flat_rope, windowed=True, mlx_lm="in_window",
         note="the whole prompt is bit-identical; cached decode past the window differs by ~1e-6 (one "
              "ulp): mlx-lm's rotating cache holds the window's keys in another order, so attention sums "
              "them in another order"),
)


def _glm4_mlx_lm(d: dict) -> dict:
    rp = d.get("rope_parameters") or {}
    return dict(flat_rope(d), partial_rotary_factor=rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5)))


register(
    Spec("glm4", lambda: tf.Glm4Config(**SMALL, head_dim=16, attention_bias=True, tie_word_embeddings=False),
         tf.Glm4ForCausalLM, "glm4", _glm4_mlx_lm, gguf_arch="glm4"),
    Spec("glm4_tied_full_rotary", lambda: tf.Glm4Config(
        **SMALL, head_dim=16, attention_bias=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
         tf.Glm4ForCausalLM, None),
)


GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=WINDOW,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
register(
    Spec("gpt_oss", lambda: tf.GptOssConfig(**{**SMALL, "num_hidden_layers": 3, "intermediate_size": 32}, **GPT_OSS),
         tf.GptOssForCausalLM, "gpt_oss", flat_rope, windowed=True,
         extra={"mlx_lm_reads_our_names": True}, gguf_arch="gpt-oss"),
    Spec("gpt_oss_yarn_untruncated", lambda: tf.GptOssConfig(
        **{**SMALL, "intermediate_size": 32}, **{**GPT_OSS, "head_dim": 32, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 32, "truncate": False}}),
         tf.GptOssForCausalLM, "gpt_oss", flat_rope, windowed=True, mlx_lm="none",
         note="mlx-lm's yarn always truncates the ramp (gpt-oss sets truncate: false)"),
)

MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32,
           n_routed_experts=8, num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
register(
    Spec("deepseek_v3", lambda: tf.DeepseekV3Config(
        **{**SMALL, "num_hidden_layers": 3, "num_key_value_heads": 4}, **MLA, q_lora_rank=48, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        tie_word_embeddings=False), tf.DeepseekV3ForCausalLM, "deepseek_v3", flat_rope, gguf_arch="deepseek2"),
    # DeepSeek V3's own RoPE: yarn with mscale == mscale_all_dim (the softmax scale takes mscale^2).
    Spec("deepseek_v3_yarn", lambda: tf.DeepseekV3Config(
        **{**SMALL, "num_key_value_heads": 4}, **{**MLA, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
        q_lora_rank=48, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        tie_word_embeddings=False), tf.DeepseekV3ForCausalLM, "deepseek_v3", flat_rope),
    Spec("deepseek_v3_no_q_lora_tied", lambda: tf.DeepseekV3Config(
        **{**SMALL, "num_key_value_heads": 4}, **{**MLA, "qk_rope_head_dim": 32}, q_lora_rank=None, n_group=1,
        topk_group=1,
        n_shared_experts=2, first_k_dense_replace=0, norm_topk_prob=False, tie_word_embeddings=True),
         tf.DeepseekV3ForCausalLM, None),
)
