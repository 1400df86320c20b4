"""Tiny random model directories for fast tests (no network, no torch).

``make_tiny_model_dir(path, family)`` writes config.json, model.safetensors,
tokenizer.json (a byte-level BPE trained here on a few sentences),
tokenizer_config.json (with a chat template) and generation_config.json.

Families (keys of :data:`CONFIGS`): ``llama``, ``mistral`` (every layer in a
sliding window of 8), ``qwen2`` (q/k/v bias), ``qwen3`` (q/k norms, explicit
head dim), ``gemma3`` and ``gemma4`` (two sliding layers then one full layer
with proportional partial RoPE; its switches, MoE, KV sharing and per-layer
inputs, are overrides: see :data:`GEMMA4_SWITCHES`).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

CORPUS = [
    "The capital of France is Paris.",
    "Hello world! This is a tiny tokenizer for tests.",
    "def f(x):\n    return x + 1\n",
    "Numbers 0123456789 and symbols ()[]{}<>",
] * 4

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CONFIGS = {
    "llama": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 320,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
    },
    "mistral": {
        "model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 320,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "sliding_window": 8,
    },
    "qwen2": {
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 320,
        "rope_theta": 1_000_000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
        "sliding_window": 8, "use_sliding_window": False,
    },
    "qwen3": {
        "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
        "vocab_size": 320, "rope_theta": 1_000_000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": 320, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 16, "sliding_window": 8, "sliding_window_pattern": 3,
        "max_position_embeddings": 256,
    },
    "gemma4": {
        "model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
        "rms_norm_eps": 1e-6, "vocab_size": 320, "vocab_size_per_layer_input": 320, "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0, "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
    },
}

S, F = "sliding_attention", "full_attention"
#: Gemma 4 config switches (overrides of ``CONFIGS["gemma4"]``), as tests/test_gemma4.py names them.
GEMMA4_SWITCHES = {
    "dense": {"tie_word_embeddings": False},
    "moe": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
            "attention_k_eq_v": True, "num_global_key_value_heads": 1},
    "kv_shared": {"num_hidden_layers": 6, "layer_types": [S, S, F, S, S, F], "num_kv_shared_layers": 2,
                  "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8},
    "ple": {"hidden_size_per_layer_input": 8},
}

#: Multiplier of every non-norm weight: spreads llama's small default init so
#: greedy choices are not near-ties (gemma scales its embeddings by sqrt(hidden)).
WEIGHT_SCALE = {"llama": 4.0, "mistral": 4.0, "qwen2": 4.0, "qwen3": 4.0, "gemma3": 1.0, "gemma4": 1.0}
#: Families whose 1-D weights (norms, layer scalars, router scales) get N(0, 1) noise: Gemma 4
#: initialises them to 1 and, with unit noise, no switch's greedy stream collapses
#: (tests/test_gemma4_decode_step.py does the same).
VECTOR_NOISE = {"gemma4"}


def make_tokenizer_json(vocab_size: int = 300) -> str:
    """A byte-level BPE with <bos>=0, <eos>=1, <pad>=2 special tokens, as JSON text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<bos>", "<eos>", "<pad>", "<|user|>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok.to_str()


def make_tiny_model_dir(path: Path, family: str = "llama", *, seed: int = 0, dtype=mx.float32,
                        vector_noise: bool | None = None, weight_scale: float | None = None,
                        embed_scale: float = 1.0, **overrides) -> Path:
    """Write a random tiny model of ``family`` into ``path`` and return ``path``.

    ``vector_noise``: add N(0, 1) to every 1-D weight (default: the families in
    :data:`VECTOR_NOISE`); ``weight_scale``: the multiplier of every other
    non-norm weight (default: :data:`WEIGHT_SCALE`); ``embed_scale``: a further
    multiplier of the embedding tables (below 1 keeps a tied head from echoing the
    last token); ``overrides`` replace config keys.
    """
    if vector_noise is None:
        vector_noise = family in VECTOR_NOISE
    from mlx_infer.models import get_model_classes

    config = dict(CONFIGS[family], **overrides)
    model_cls, args_cls = get_model_classes(config["model_type"])
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    scale = WEIGHT_SCALE[family] if weight_scale is None else weight_scale
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if vector_noise and v.ndim <= 1:
            v = v + mx.random.normal(v.shape)
        elif "norm" not in k:
            v = v * scale * (embed_scale if "embed_tokens" in k else 1.0)
        weights[k] = v.astype(dtype)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer.json").write_text(make_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
    }))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return path
