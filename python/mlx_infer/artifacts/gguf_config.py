"""GGUF metadata, typed and range-checked, and the HF ``config.json`` dict built from it.

Every metadata key mlx-infer reads from a GGUF goes through one of the
accessors here (:class:`Meta`), which check its type and range and name the key
and the file when they are wrong; :func:`check_tokenizer_metadata` does the
same for the ``tokenizer.ggml.*`` keys before the vocabulary is rebuilt.
:func:`build_config` turns the checked values into an HF config (llama.cpp's
names and conventions undone).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ModelLoadError, UnsupportedModelError
from .gguf_families import FAMILY_ARCHITECTURES, family_config

if TYPE_CHECKING:
    from .gguf import GGUFHeader, GGUFTensorInfo

# GGUF `general.architecture` -> HF model_type / architectures entry.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
ARCHITECTURES.update(FAMILY_ARCHITECTURES)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(ARCHITECTURES))

_F32_MAX = 3.4028234663852886e38
_MAX_DIM = 1 << 20
_MAX_HEADS = 1 << 12
_MAX_HEAD_DIM = 1 << 13
_MAX_LAYERS = 1 << 12
_MAX_VOCAB = 1 << 24
_MAX_CONTEXT = 1 << 30
_REQUIRED = object()


class Meta:
    """Typed reads of a GGUF header's metadata; every failure names the key and the file."""

    def __init__(self, header: "GGUFHeader"):
        self.header = header
        self.meta = header.metadata
        self.arch = header.architecture

    def _error(self, key: str, rule: str, value: Any) -> ModelLoadError:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return ModelLoadError(f"{self.header.path}: GGUF metadata {key!r} must be {rule}, got {shown}. "
                              "The file is damaged or was written by an incompatible tool; re-export it with llama.cpp.")

    def _get(self, key: str, default: Any) -> Any:
        if key in self.meta:
            return self.meta[key]
        if default is _REQUIRED:
            raise ModelLoadError(
                f"{self.header.path} lacks the metadata key {key!r}, which every {self.arch} GGUF has. "
                "The file is damaged or was written by an incompatible tool; re-export it with llama.cpp.")
        return default

    def integer(self, key: str, *, lo: int = 0, hi: int = 1 << 63, default: Any = _REQUIRED) -> Any:
        """An integer in ``[lo, hi]`` (GGUF bools are not integers here)."""
        v = self._get(key, default)
        if v is default and default is not _REQUIRED:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._error(key, "an integer", v)
        if not lo <= v <= hi:
            raise self._error(key, f"in [{lo}, {hi}]", v)
        return v

    def uniform_int(self, key: str, *, lo: int, hi: int, default: Any = _REQUIRED) -> Any:
        """An integer, or a per-layer list of equal integers (llama.cpp writes either)."""
        v = self._get(key, default)
        if isinstance(v, list):
            if not v:
                raise self._error(key, "an integer or a non-empty list of integers", v)
            for x in v:
                if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
                    raise self._error(key, f"a list of integers in [{lo}, {hi}]", v)
            if len(set(v)) != 1:
                raise UnsupportedModelError(
                    f"{self.header.path} has a different {key} per layer ({v[:8]}...); not supported.")
            return v[0]
        return self.integer(key, lo=lo, hi=hi, default=default)

    def number(self, key: str, *, lo: float = -_F32_MAX, hi: float = _F32_MAX, lo_open: bool = False,
              default: Any = _REQUIRED) -> Any:
        """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
        v = self._get(key, default)
        if v is default and default is not _REQUIRED:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self._error(key, "a finite number", v)
        if v < lo or v > hi or (lo_open and v == lo):
            raise self._error(key, f"{'>' if lo_open else '>='} {lo:g} and <= {hi:g}", v)
        return float(v)

    def string(self, key: str, default: Any = _REQUIRED) -> Any:
        v = self._get(key, default)
        if v is default and default is not _REQUIRED:
            return v
        if not isinstance(v, str):
            raise self._error(key, "a string", v)
        return v

    def flag(self, key: str, default: Any = _REQUIRED) -> Any:
        v = self._get(key, default)
        if v is default and default is not _REQUIRED:
            return v
        if not isinstance(v, bool):
            raise self._error(key, "a bool", v)
        return v

    def array(self, key: str, of: tuple[type, ...], *, length: int | None = None, default: Any = _REQUIRED) -> Any:
        """A list whose elements are all of the types ``of`` (bools never count as numbers)."""
        v = self._get(key, default)
        if v is default and default is not _REQUIRED:
            return v
        names = " or ".join(t.__name__ for t in of)
        if not isinstance(v, list):
            raise self._error(key, f"an array of {names}", v)
        numeric = int in of or float in of
        for x in v:
            if not isinstance(x, of) or (numeric and bool not in of and isinstance(x, bool)):
                raise self._error(key, f"an array of {names} (found an element {x!r})", type(x).__name__)
        if length is not None and len(v) != length:
            raise self._error(key, f"an array of {length} entries", f"{len(v)} entries")
        return v


def check_tokenizer_metadata(header: "GGUFHeader") -> None:
    """Type- and range-check the ``tokenizer.ggml.*`` keys the vocabulary is rebuilt from.

    Raises:
        ModelLoadError: a key of the wrong type, an array of the wrong length, a
            special-token id outside the vocabulary, or a merge that is not ``"a b"``.
    """
    m = Meta(header)
    tokens = m.array("tokenizer.ggml.tokens", (str,), default=None)
    if tokens is None:
        return  # build_tokenizer says the vocabulary is missing
    n = len(tokens)
    if not 0 < n <= _MAX_VOCAB:
        raise m._error("tokenizer.ggml.tokens", f"a list of 1 to {_MAX_VOCAB} tokens", f"{n} tokens")
    m.string("tokenizer.ggml.model")
    m.string("tokenizer.ggml.pre", default=None)
    m.array("tokenizer.ggml.token_type", (int,), length=n, default=None)
    scores = m.array("tokenizer.ggml.scores", (int, float), length=n, default=None)
    if scores is not None and any(math.isnan(x) for x in scores):
        raise m._error("tokenizer.ggml.scores", "numbers (no NaN)", "NaN")
    merges = m.array("tokenizer.ggml.merges", (str,), default=None)
    for merge in merges or ():
        if len(merge.split(" ")) != 2:
            raise m._error("tokenizer.ggml.merges", "merges of two tokens separated by one space", merge)
    for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "eot_token_id", "eom_token_id"):
        m.integer(f"tokenizer.ggml.{k}", lo=0, hi=n - 1, default=None)
    m.integer("tokenizer.ggml.padding_token_id", lo=0, hi=(1 << 32) - 1, default=None)
    for k in ("add_bos_token", "add_eos_token"):
        m.flag(f"tokenizer.ggml.{k}", default=None)
    m.string("tokenizer.chat_template", default=None)


def model_type(header: "GGUFHeader") -> tuple[str, str]:
    """``(HF model_type, HF architectures entry)`` of a GGUF, refusing unsupported architectures."""
    arch = header.metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{header.path} holds a GGUF of architecture {arch!r}, which mlx-infer cannot run. "
            f"Supported GGUF architectures: {', '.join(SUPPORTED_ARCHITECTURES)} (Mistral files use 'llama'). "
            "Use a supported model, or an HF/MLX directory of a supported family."
        )
    mt, hf_arch = ARCHITECTURES[arch]
    name = Meta(header).string("general.name", default="").lower()
    if arch == "llama" and "mistral" in name:
        mt, hf_arch = "mistral", "MistralForCausalLM"
    return mt, hf_arch


def _f32(x: Any) -> float:
    """The shortest decimal that is the same float32 (GGUF stores f32: 1e-6, not 9.99999997e-07)."""
    return float(str(np.float32(x)))


def llama3_rope_scaling(factors: np.ndarray, base: float, dims: int, path: Any = "The GGUF") -> dict[str, Any]:
    """Recover llama3 rope_scaling from llama.cpp's `rope_freqs` tensor (it writes factors, not params)."""
    if factors.size == 0 or not np.all(np.isfinite(factors)) or factors.min() <= 0:
        raise ModelLoadError(f"{path}: the rope_freqs tensor holds non-positive or non-finite factors; "
                             "re-export the file with llama.cpp.")
    factor = float(factors.max())
    freqs = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
    wavelen = 2 * math.pi / freqs
    for original in (8192, 4096, 16384, 2048, 32768):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)):
            low_wl, high_wl = original / low, original / high
            smooth = (original / wavelen - low) / (high - low)
            expect = np.where(
                wavelen < high_wl, 1.0,
                np.where(wavelen > low_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)),
            )
            if expect.shape == factors.shape and np.allclose(expect, factors, rtol=1e-4, atol=1e-4):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": original}
    raise UnsupportedModelError(
        f"{path}: the rope_freqs tensor (llama3-style RoPE scaling) has factors that match no known "
        "llama3 rope_scaling; convert the original HF checkpoint instead."
    )


def _rope_scaling(m: Meta) -> dict[str, Any] | None:
    arch = m.arch
    kind = m.string(f"{arch}.rope.scaling.type", default=None)
    factor = m.number(f"{arch}.rope.scaling.factor", lo=0.0, lo_open=True, default=None)
    if kind in (None, "none") or not factor or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(factor)}
        orig = m.integer(f"{arch}.rope.scaling.original_context_length", lo=0, hi=_MAX_CONTEXT, default=None)
        if orig:
            out["original_max_position_embeddings"] = orig
        return out
    raise UnsupportedModelError(
        f"{m.header.path} uses RoPE scaling {kind!r}, which is not supported; supported: linear, yarn, llama3."
    )


def build_config(header: "GGUFHeader", tensors: dict[str, "GGUFTensorInfo"], n_vocab: int | None,
                 rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """The HF ``config.json`` dict of a GGUF, every metadata key type- and range-checked."""
    m = Meta(header)
    arch = m.arch
    mt, hf_arch = model_type(header)
    a = f"{arch}."

    hidden = m.integer(a + "embedding_length", lo=1, hi=_MAX_DIM)
    heads = m.uniform_int(a + "attention.head_count", lo=1, hi=_MAX_HEADS)
    kv_heads = m.uniform_int(a + "attention.head_count_kv", lo=1, hi=_MAX_HEADS, default=heads)
    if heads % kv_heads:
        raise m._error(a + "attention.head_count_kv", f"a divisor of {a}attention.head_count ({heads})", kv_heads)
    head_dim = m.integer(a + "attention.key_length", lo=1, hi=_MAX_HEAD_DIM, default=None)
    if head_dim is None and arch == "llama":
        head_dim = m.integer(a + "rope.dimension_count", lo=1, hi=_MAX_HEAD_DIM, default=None)
    if head_dim is None:
        if hidden < heads:
            raise m._error(a + "embedding_length", f">= {a}attention.head_count ({heads})", hidden)
        head_dim = hidden // heads
    n_layers = m.integer(a + "block_count", lo=1, hi=_MAX_LAYERS)

    embed = tensors.get("token_embd.weight")
    vocab_size = embed.shape[0] if embed is not None else (
        m.integer(a + "vocab_size", lo=1, hi=_MAX_VOCAB, default=None) or n_vocab)
    if vocab_size is None:
        raise ModelLoadError(f"{header.path} has neither a token_embd.weight tensor nor a vocabulary; "
                             "re-export it with llama.cpp.")
    if n_vocab is not None and n_vocab > vocab_size:
        raise ModelLoadError(f"{header.path}: the vocabulary has {n_vocab} tokens but the embedding only "
                             f"{vocab_size} rows; token ids past {vocab_size - 1} would read outside it.")
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": mt,
        "hidden_size": hidden,
        "intermediate_size": m.uniform_int(a + "feed_forward_length", lo=1, hi=_MAX_DIM),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(m.number(a + "attention.layer_norm_rms_epsilon", lo=0.0, hi=1.0, lo_open=True)),
        "rope_theta": _f32(m.number(a + "rope.freq_base", lo=0.0, lo_open=True, default=10000.0)),
        "vocab_size": int(vocab_size),
        "max_position_embeddings": m.integer(a + "context_length", lo=1, hi=_MAX_CONTEXT, default=4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_scaling": _rope_scaling(m),
    }
    for name, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("pad_token_id", "padding_token_id")):
        value = m.integer(f"tokenizer.ggml.{gguf_key}", lo=0, hi=(1 << 32) - 1, default=None)
        if value is not None:
            config[name] = value

    if arch in ("llama", "qwen2", "qwen3"):
        config["hidden_act"] = "silu"
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        if arch == "llama":
            config["mlp_bias"] = False
        if rope_freqs is not None:
            config["rope_scaling"] = llama3_rope_scaling(rope_freqs, config["rope_theta"], config["head_dim"],
                                                         header.path)
        if mt == "mistral":
            window = m.integer(a + "attention.sliding_window", lo=0, hi=_MAX_CONTEXT, default=None)
            config["sliding_window"] = window or None
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "gemma3":
        key = a + "attention.sliding_window_pattern"
        pattern = m.meta.get(key)
        if isinstance(pattern, list):  # one bool per layer: True = sliding
            m.array(key, (bool,), length=n_layers)
            layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
            full = [i for i, s in enumerate(pattern) if not s]
            period = full[0] + 1 if full else n_layers + 1
        else:
            period = m.integer(key, lo=1, hi=_MAX_LAYERS, default=6)  # llama.cpp hard-codes Gemma 3's 5 local : 1 global
            layer_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]
        scale = m.number(a + "attention.scale", lo=0.0, lo_open=True, default=None)
        if scale:
            query_pre_attn_scalar = _f32(1.0 / (scale ** 2))
        elif n_layers == 62:  # Gemma 3 27B scales by hidden/heads (llama.cpp does the same)
            query_pre_attn_scalar = hidden // heads
        else:
            query_pre_attn_scalar = head_dim
        config.update({
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": query_pre_attn_scalar,
            "sliding_window": m.integer(a + "attention.sliding_window", lo=1, hi=_MAX_CONTEXT, default=512),
            "sliding_window_pattern": period,
            "layer_types": layer_types,
            "rope_local_base_freq": _f32(m.number(a + "rope.freq_base_swa", lo=0.0, lo_open=True, default=10000.0)),
            "final_logit_softcapping": m.number(a + "final_logit_softcapping", lo=0.0, lo_open=True, default=None),
            "attn_logit_softcapping": m.number(a + "attn_logit_softcapping", lo=0.0, lo_open=True, default=None),
            "attention_bias": False,
        })
    if arch in FAMILY_ARCHITECTURES:
        family_config(m, config, tensors)
    return config
