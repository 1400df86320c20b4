"""Tiny random model directories for fast tests (no network, no torch).

``make_tiny_model_dir(path, family)`` writes config.json, model.safetensors,
tokenizer.json (a byte-level BPE trained here on a few sentences),
tokenizer_config.json (with a chat template) and generation_config.json.
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
    "gemma3": {
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": 320, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 16, "sliding_window": 8, "sliding_window_pattern": 3,
        "max_position_embeddings": 256,
    },
}


WEIGHT_SCALE = {"llama": 4.0, "gemma3": 1.0}


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
                        **overrides) -> Path:
    """Write a random tiny model of ``family`` into ``path`` and return ``path``."""
    from mlx_infer.models import get_model_classes

    config = dict(CONFIGS[family], **overrides)
    model_cls, args_cls = get_model_classes(config["model_type"])
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # Spread llama's small default init so greedy choices are not near-ties;
    # gemma3 already scales its embeddings by sqrt(hidden).
    scale = WEIGHT_SCALE[family]
    weights = {k: (v * scale).astype(dtype) if "norm" not in k else v.astype(dtype)
               for k, v in tree_flatten(model.parameters())}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer.json").write_text(make_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
    }))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return path
