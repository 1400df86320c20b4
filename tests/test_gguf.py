"""read_gguf: GGUF -> HF config, HF-named weights and tokenizer, checked against transformers.

Tiny GGUF files are written here with ``gguf.GGUFWriter`` the way llama.cpp's converter writes
them (q/k rows permuted for llama, +1 on Gemma norms, tokenizer metadata), then read both by
``read_gguf`` and by transformers' own GGUF loader (``from_pretrained(..., gguf_file=...)``).

Tolerances: dequantized weights must be bit-identical to transformers' (atol = 0; both
dequantize with the gguf package in float32); config floats are compared after rounding to
float32 (GGUF stores f32, we write the shortest decimal of it); token ids and decoded text
must be equal.
"""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from mlx_infer.artifacts.gguf import SUPPORTED_ARCHITECTURES, read_gguf, read_gguf_header  # noqa: E402
from mlx_infer.errors import ModelLoadError, UnsupportedModelError  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Writing tiny GGUF files

_CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "def main():\n    print('hello world')\n    return 42\n",
    "Unicode: café, naïve, Ελληνικά, 日本語のテキスト, emoji 🎉🙂 and tabs\tand   spaces.",
    "the theory of the thing is that they think there then these those",
] * 20

TEXTS = [
    "Hello world", "The capital of France is", "  leading spaces", "trailing   ", "a  b   c    d",
    "tabs\tand\nnewlines\n\n\nmany\n", "emoji 🎉🙂👩‍👩‍👧 ok", "Ελληνικά 日本語のテキスト café naïve",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<|im_start|>user\nhi<|im_end|>",
    "<think>reasoning</think> done", "def f(x):\n    return x**2  # comment\n", "", " ", "\n",
    "mixed\r\nCRLF", "\u00a0nbsp\u2003emsp", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 1234567890 3.14159", "https://example.com/a?b=c&d=e",
    "<bos>text<eos> <unused0> <mask>",
]


def _train_bpe(byte_level: bool) -> tuple[list[str], list[str]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    return tokens, [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]


def spm_vocab() -> dict:
    """A llama-style sentencepiece vocabulary: <unk>/<s>/</s>, byte tokens, scored pieces, extras."""
    pieces, _ = _train_bpe(False)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    for p in pieces:
        if p not in tokens:
            tokens.append(p)
            types.append(1)
    for t, ty in (("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4)):
        tokens.append(t)
        types.append(ty)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return dict(model="llama", tokens=tokens, types=types, scores=scores, bos=1, eos=2, unk=0)


def bpe_vocab() -> dict:
    """A byte-level (gpt2) vocabulary with merges and Qwen-style specials."""
    tokens, merges = _train_bpe(True)
    types = [1] * len(tokens)
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        tokens.append(t)
        types.append(3)
    tokens.append("<think>")
    types.append(4)
    return dict(model="gpt2", pre="qwen2", tokens=tokens, types=types, merges=merges,
                bos=tokens.index("<|endoftext|>"), eos=tokens.index("<|im_end|>"))


def gemma_vocab() -> dict:
    """A Gemma-style vocabulary: control tokens, whitespace user tokens, byte tokens, no merges."""
    pieces, _ = _train_bpe(False)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<unused0>"]
    types = [3] * len(tokens)
    tokens += ["\n", "\n\n", "  ", "   "]
    types += [4] * 4
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    for p in pieces:
        if p not in tokens:
            tokens.append(p)
            types.append(1)
    return dict(model="llama", pre="default", tokens=tokens, types=types, scores=[0.0] * len(tokens),
                bos=2, eos=1, unk=3, pad=0)


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LEAVES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_GEMMA_LEAVES = {**_LEAVES, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_TOP = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm"}


def write_tiny_gguf(path, arch="llama", vocab=None, *, n_layers=2, hidden=64, heads=4, kv_heads=2,
                    head_dim=None, inter=128, qtype=Q.Q8_0, tie=False, seed=0, name="tiny",
                    chat_template=None, extra_tensors=None, rope_freqs=None):
    """Write a tiny GGUF as llama.cpp's converter would; return its HF-layout float32 weights.

    2-D weights are stored as ``qtype`` (F32, F16 or a quantized type), 1-D ones as F32.
    """
    rng = np.random.default_rng(seed)
    vocab = vocab or spm_vocab()
    n_vocab = len(vocab["tokens"])
    hd = head_dim or hidden // heads
    gemma = arch == "gemma3"

    def rnd(*shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n):  # HF Gemma norms multiply by (1 + w); the others by w
        return rnd(n, scale=0.1) + (0.0 if gemma else 1.0)

    hf = {"model.embed_tokens.weight": rnd(n_vocab, hidden)}
    if not tie:
        hf["lm_head.weight"] = rnd(n_vocab, hidden)
    hf["model.norm.weight"] = norm(hidden)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        hf[p + "self_attn.q_proj.weight"] = rnd(heads * hd, hidden)
        hf[p + "self_attn.k_proj.weight"] = rnd(kv_heads * hd, hidden)
        hf[p + "self_attn.v_proj.weight"] = rnd(kv_heads * hd, hidden)
        hf[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * hd)
        hf[p + "mlp.gate_proj.weight"] = rnd(inter, hidden)
        hf[p + "mlp.up_proj.weight"] = rnd(inter, hidden)
        hf[p + "mlp.down_proj.weight"] = rnd(hidden, inter)
        hf[p + "input_layernorm.weight"] = norm(hidden)
        hf[p + "post_attention_layernorm.weight"] = norm(hidden)
        if arch == "qwen2":
            for n, d in (("q", heads * hd), ("k", kv_heads * hd), ("v", kv_heads * hd)):
                hf[p + f"self_attn.{n}_proj.bias"] = rnd(d)
        if arch in ("qwen3", "gemma3"):
            hf[p + "self_attn.q_norm.weight"] = norm(hd)
            hf[p + "self_attn.k_norm.weight"] = norm(hd)
        if gemma:
            hf[p + "pre_feedforward_layernorm.weight"] = norm(hidden)
            hf[p + "post_feedforward_layernorm.weight"] = norm(hidden)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0 if gemma else 10_000.0)
    if arch == "llama":
        w.add_rope_dimension_count(hd)
    if arch in ("gemma3", "qwen3"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    if gemma:
        w.add_sliding_window(16)
    w.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    if "unk" in vocab:
        w.add_unk_token_id(vocab["unk"])
    if "pad" in vocab:
        w.add_pad_token_id(vocab["pad"])
    if chat_template:
        w.add_chat_template(chat_template)

    leaves = _GEMMA_LEAVES if gemma else {**_LEAVES, "post_attention_layernorm": "ffn_norm"}
    tensors = {}
    for hname, arr in hf.items():
        base, suffix = hname.rsplit(".", 1)
        if base in _TOP:
            gname = _TOP[base]
        else:
            _, _, idx, rest = base.split(".", 3)
            gname = f"blk.{idx}.{leaves[rest]}"
        data = arr
        if arch == "llama" and gname.endswith("attn_q"):
            data = llama_permute(data, heads, heads)
        elif arch == "llama" and gname.endswith("attn_k"):
            data = llama_permute(data, heads, kv_heads)
        if gemma and gname.endswith("norm"):
            data = data + np.float32(1.0)
        tensors[f"{gname}.{suffix}"] = data
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs.astype(np.float32)
    tensors.update(extra_tensors or {})
    for gname, data in tensors.items():
        if data.ndim == 2 and qtype == Q.F16:
            w.add_tensor(gname, data.astype(np.float16))
        elif data.ndim == 2 and qtype != Q.F32 and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _hf_from_gguf(path):
    """transformers' model and tokenizer from a GGUF file (its reference GGUF loader)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def _assert_tokenizer_parity(tokenizer_json: str, hf_tok, texts=TEXTS):
    """Same ids (with and without special tokens) and the same decoded text as transformers."""
    from tokenizers import Tokenizer

    ours = Tokenizer.from_str(tokenizer_json)
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special).ids
            assert ids == hf_tok(text, add_special_tokens=special).input_ids, (text, special)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip), (
                    text, special, skip)


def _assert_weights_equal(weights: dict, hf_model):
    """Every tensor transformers has (tied lm_head aside) is ours, bit-identical (atol = 0)."""
    ref = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        ref.pop("lm_head.weight", None)
    assert set(weights) == set(ref)
    for k, v in weights.items():
        np.testing.assert_array_equal(np.array(v), ref[k], err_msg=k)


_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id")


def _assert_config_matches(config: dict, hf_config, keys=_CONFIG_KEYS):
    for k in keys:
        assert config[k] == getattr(hf_config, k), k
    assert np.float32(config["rms_norm_eps"]) == np.float32(hf_config.rms_norm_eps)


# ---------------------------------------------------------------------------------------------
# Tiny files, checked against transformers


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F32], ids=["Q8_0", "F32"])
def test_tiny_llama_matches_transformers(tmp_path, qtype):
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama", spm_vocab(), qtype=qtype,
                    chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    art = read_gguf(path)
    model, tok = _hf_from_gguf(path)
    assert art.config["model_type"] == "llama"
    _assert_config_matches(art.config, model.config)
    assert art.config["rope_theta"] == model.config.rope_parameters["rope_theta"]
    _assert_weights_equal(art.weights, model)  # includes the q/k un-permutation
    _assert_tokenizer_parity(art.tokenizer_json, tok)
    assert art.tokenizer_config["chat_template"] == tok.chat_template
    assert art.tokenizer_config["bos_token"] == "<s>" and art.tokenizer_config["add_bos_token"] is True


def test_llama_qk_unpermuted_to_hf_layout(tmp_path):
    """With F32 storage the un-permuted q/k equal the HF weights the file was made from, exactly."""
    path = tmp_path / "llama.gguf"
    hf = write_tiny_gguf(path, "llama", qtype=Q.F32, heads=4, kv_heads=2)
    art = read_gguf(path)
    for k, v in hf.items():
        np.testing.assert_array_equal(np.array(art.weights[k]), v, err_msg=k)


def test_tiny_qwen2_byte_level_matches_transformers(tmp_path):
    path = tmp_path / "qwen2.gguf"
    write_tiny_gguf(path, "qwen2", bpe_vocab())
    art = read_gguf(path)
    model, tok = _hf_from_gguf(path)
    assert art.config["model_type"] == "qwen2" and art.config["attention_bias"] is True
    _assert_config_matches(art.config, model.config, [k for k in _CONFIG_KEYS if k != "head_dim"])
    _assert_weights_equal(art.weights, model)
    _assert_tokenizer_parity(art.tokenizer_json, tok)
    assert art.tokenizer_config["add_bos_token"] is False
    assert art.generation_config["eos_token_id"] == [302, 300]  # <|im_end|>, then <|endoftext|>


def test_tiny_qwen3_f16_matches_transformers(tmp_path):
    path = tmp_path / "qwen3.gguf"
    # transformers ignores qwen3's key_length and assumes head_dim 128, so use 128 here.
    write_tiny_gguf(path, "qwen3", bpe_vocab(), heads=2, kv_heads=1, head_dim=128, qtype=Q.F16)
    art = read_gguf(path)
    model, _ = _hf_from_gguf(path)
    assert art.config["model_type"] == "qwen3" and art.config["head_dim"] == 128
    _assert_config_matches(art.config, model.config)
    _assert_weights_equal(art.weights, model)


def test_tiny_gemma3_matches_transformers(tmp_path):
    path = tmp_path / "gemma3.gguf"
    hf = write_tiny_gguf(path, "gemma3", gemma_vocab(), heads=4, kv_heads=1, head_dim=32, tie=True)
    art = read_gguf(path)
    model, tok = _hf_from_gguf(path)
    cfg = art.config
    assert cfg["model_type"] == "gemma3_text" and cfg["tie_word_embeddings"] is True
    _assert_config_matches(cfg, model.config)
    assert cfg["sliding_window"] == model.config.sliding_window == 16
    assert cfg["layer_types"] == model.config.layer_types
    _assert_weights_equal(art.weights, model)  # norms: the stored 1 + w, minus 1
    np.testing.assert_allclose(np.array(art.weights["model.layers.1.post_feedforward_layernorm.weight"]),
                               hf["model.layers.1.post_feedforward_layernorm.weight"], atol=1e-7)
    _assert_tokenizer_parity(art.tokenizer_json, tok)
    assert art.generation_config["eos_token_id"] == [1, 6]  # <eos>, <end_of_turn>


def test_tiny_llama_logits_match_transformers_through_mlx_lm(tmp_path):
    """End to end: GGUF -> MLX dir -> mlx-lm logits equal transformers' on the same GGUF
    (atol 1e-4 on logits of magnitude ~1; float32 on both sides). Catches a wrong RoPE layout."""
    import mlx_lm
    import torch

    from mlx_infer.artifacts.convert import convert

    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama", spm_vocab(), qtype=Q.F32)
    out = convert(path, tmp_path / "mlx", progress=False)
    model, tok = mlx_lm.load(str(out))
    hf_model, _ = _hf_from_gguf(path)
    ids = [1, 300, 301, 302, 310, 320, 330, 340, 350, 360]
    ours = np.array(model(mx.array([ids])))
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# Config details


def test_dtype_and_metadata(tmp_path):
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama")
    art = read_gguf(path, dtype="bfloat16")
    assert {v.dtype for v in art.weights.values()} == {mx.bfloat16}
    assert art.config["torch_dtype"] == "bfloat16"
    assert art.config["rms_norm_eps"] == 1e-6  # the f32-stored value, written as its shortest decimal
    assert art.metadata["general.architecture"] == "llama"
    with pytest.raises(ValueError, match="dtype"):
        read_gguf(path, dtype="int8")


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """llama.cpp writes Llama 3.1's RoPE scaling as a `rope_freqs` tensor; it comes back as rope_scaling."""
    dims, base = 16, 10_000.0  # the tiny file's head_dim and rope base
    factor, low, high, orig = 8.0, 1.0, 4.0, 8192
    wavelen = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (orig / wavelen - low) / (high - low)
    factors = np.where(wavelen < orig / high, 1.0,
                       np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, "llama", heads=4, hidden=64, rope_freqs=factors)
    assert "rope_freqs.weight" in {t.name for t in read_gguf_header(path).tensors}
    art = read_gguf(path)
    assert art.config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert not any("rope" in k for k in art.weights)


def test_tensor_names_invert_gguf_name_map():
    """Our GGUF -> HF names are the inverse of the gguf package's HF -> GGUF map for each arch."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    from mlx_infer.artifacts.gguf import _hf_name

    leaves = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
              "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
              "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
              "mlp.down_proj"]
    hf_names = ["model.embed_tokens", "model.norm", "lm_head"] + [f"model.layers.1.{x}" for x in leaves]
    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        name_map = get_tensor_name_map(MODEL_ARCH[arch.upper()], 2)
        mapped = 0
        for hf in hf_names:
            g = name_map.get_name(hf)
            if g is not None:
                assert _hf_name(arch, g + ".weight", "x.gguf") == hf + ".weight", (arch, hf, g)
                mapped += 1
        assert mapped >= 12


def test_pre_tokenizer_regexes_equal_transformers():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from mlx_infer.artifacts.gguf_tokenizer import _PRE_TOKENIZER_SPLITS

    assert _PRE_TOKENIZER_SPLITS == GGUF_PRE_TOKENIZER_SPLITS


# ---------------------------------------------------------------------------------------------
# Errors


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf(p)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf(empty)


@pytest.mark.parametrize("keep", [10, 200, 5000, -100, -1])
def test_truncated_gguf(tmp_path, keep):
    """Cut anywhere (header, metadata, tensor table, data): a clear 'truncated' error, no crash."""
    src = tmp_path / "full.gguf"
    write_tiny_gguf(src, "llama")
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        read_gguf(cut)
    assert "again" in str(e.value) or "Re-download" in str(e.value)


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(p), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as e:
        read_gguf(p)
    msg = str(e.value)
    assert "'falcon'" in msg and all(a in msg for a in SUPPORTED_ARCHITECTURES)


def test_unknown_tensor_is_not_dropped_silently(tmp_path):
    p = tmp_path / "moe.gguf"
    write_tiny_gguf(p, "llama", extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((2, 64), np.float32)})
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_gate_exps.weight"):
        read_gguf(p)


# ---------------------------------------------------------------------------------------------
# The real model (Gemma 3 270M, Q4_K_M)


@pytest.fixture(scope="module")
def real_artifact(real_gguf):
    return read_gguf(real_gguf)


@pytest.mark.slow
def test_real_config(real_artifact, hf_gguf_model):
    model, _ = hf_gguf_model
    cfg, ref = real_artifact.config, model.config
    _assert_config_matches(cfg, ref)
    assert cfg["model_type"] == "gemma3_text" == ref.model_type
    assert cfg["layer_types"] == ref.layer_types
    assert cfg["sliding_window"] == ref.sliding_window == 512
    assert cfg["sliding_window_pattern"] == 6
    assert cfg["query_pre_attn_scalar"] == ref.query_pre_attn_scalar == 256
    assert cfg["rope_theta"] == ref.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg["rope_local_base_freq"] == ref.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert cfg["hidden_activation"] == ref.hidden_activation
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["pad_token_id"] == 0
    assert real_artifact.generation_config == {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}
    tc = real_artifact.tokenizer_config
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == ("<bos>", "<eos>", True)


@pytest.mark.slow
def test_real_weights_equal_transformers(real_artifact, hf_gguf_model):
    """All 236 tensors, bit-identical to transformers' dequantization (norms minus 1 included)."""
    _assert_weights_equal(real_artifact.weights, hf_gguf_model[0])


@pytest.mark.slow
def test_real_tokenizer_matches_transformers(real_artifact, hf_gguf_model):
    _assert_tokenizer_parity(real_artifact.tokenizer_json, hf_gguf_model[1])


@pytest.mark.slow
def test_real_convert_q4_loads_in_mlx_lm(real_gguf, real_artifact, tmp_path):
    import mlx_lm

    from mlx_infer.artifacts.convert import convert

    out = convert(real_gguf, tmp_path / "q4", quantize_bits=4, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == cfg["quantization_config"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    model, tok = mlx_lm.load(str(out))
    layer = model.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == "QuantizedLinear" and layer.bits == 4
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    text = mlx_lm.generate(model, tok, "The capital of France is", max_tokens=4, verbose=False)
    assert isinstance(text, str) and text.strip()


@pytest.mark.slow
def test_real_dense_dir_gives_the_oracle_continuation(real_artifact, tmp_path):
    """mlx-lm on our dense float32 directory continues greedily as the oracle says."""
    import mlx_lm

    from mlx_infer.artifacts.convert import write_mlx_dir

    a = real_artifact
    out = write_mlx_dir(a.config, a.weights, tmp_path / "dense", tokenizer_json=a.tokenizer_json,
                        tokenizer_config=a.tokenizer_config, generation_config=a.generation_config, progress=False)
    model, tok = mlx_lm.load(str(out))
    text = mlx_lm.generate(model, tok, "The capital of France is", max_tokens=8, verbose=False)
    assert text.startswith(" the capital of the country of France."), text
