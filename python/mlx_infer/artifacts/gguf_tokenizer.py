"""The vocabulary of a GGUF file rebuilt as an HF ``tokenizers`` JSON (no transformers needed).

It encodes and decodes as transformers' ``AutoTokenizer.from_pretrained(...,
gguf_file=...)`` does for the two GGUF tokenizer kinds read here: ``llama``
(sentencepiece-style, scores as merge priorities) and ``gpt2`` (byte-level BPE
with the pre-tokenizer regex named by ``tokenizer.ggml.pre``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    from .gguf import GGUFHeader

# Token types of `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# Tokens llama.cpp treats as end-of-generation when the vocabulary marks them control.
_END_OF_TURN_TOKENS = (
    "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<EOT>",
)

# Pre-tokenizer split regexes by `tokenizer.ggml.pre` (the ones transformers knows, same strings).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}



def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Rebuild BPE merges from a sentencepiece vocabulary: every split of a token into two
    tokens, best score first (transformers' `generate_merges` with scores, same order)."""
    merges = []
    for piece, score in scores.items():
        local = []
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def build_tokenizer(header: "GGUFHeader") -> tuple[str, dict[str, Any]]:
    """`(tokenizer.json text, tokenizer_config dict)` from the `tokenizer.ggml.*` metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    meta = header.metadata
    arch = header.architecture
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(
            f"{header.path} has no tokenizer (tokenizer.ggml.tokens is missing). Use a GGUF exported with "
            "its vocabulary, or convert the original HF checkpoint."
        )
    types = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    named: dict[str, str | None] = {}
    for name, k in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        idx = meta.get(f"tokenizer.ggml.{k}")
        named[name] = tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    byte_level = kind == "gpt2"
    spelled = set(_bytes_to_unicode().values()) if byte_level else None
    if kind == "llama":
        gemma = arch.startswith("gemma")
        if gemma:
            # Gemma stores multi-space tokens as real spaces; its normalizer maps ' ' -> '▁', and the
            # file's merge order is the token order (its scores do not follow it).
            vocab_tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
            ranking = {t: -i for i, t in enumerate(vocab_tokens)}
        else:
            vocab_tokens = list(tokens)
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            ranking = dict(zip(vocab_tokens, scores))
        vocab = {t: i for i, t in enumerate(vocab_tokens)}
        if "tokenizer.ggml.merges" in meta:
            merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
        else:
            merges = _merges_from_vocab(vocab, ranking)
        if gemma:
            tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>", dropout=None,
                                byte_fallback=True))
            tok.normalizer = normalizers.Replace(" ", "\u2581")
            tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
            if "<mask>" in vocab:  # GemmaTokenizer's default mask token
                named["mask_token"] = "<mask>"
        else:
            tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(content=" ", left=1)])
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    elif byte_level:
        table = _bytes_to_unicode()
        vocab = {
            (t if set(t) <= spelled else "".join(table[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
        split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
        if split is not None:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    else:
        raise UnsupportedModelError(
            f"{header.path} uses tokenizer model {kind!r}; supported GGUF tokenizers: 'llama' "
            "(sentencepiece BPE) and 'gpt2' (byte-level BPE)."
        )
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))

    # Control tokens are special; user-defined ones are matched whole but are not special.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types)
        if ty == _TOKEN_CONTROL and (spelled is None or set(t) <= spelled)
    ]
    if control:
        tok.add_special_tokens(control)
    known = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED and t in known]
    if user:
        tok.add_tokens(user)
    added = {a.content for a in tok.get_added_tokens_decoder().values()}
    extra = [AddedToken(t, special=True) for t in dict.fromkeys(v for v in named.values() if v)
             if t not in added and t in known]
    if extra:
        tok.add_tokens(extra)

    bos, eos = named["bos_token"], named["eos_token"]
    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
    pair = " ".join([single] + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
    specials = ([(bos, tok.token_to_id(bos))] if add_bos else []) + ([(eos, tok.token_to_id(eos))] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: v for k, v in named.items() if v is not None},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{arch}.context_length", 0)) or None,
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:  # none is invented: a GGUF without one is a base model
        config["chat_template"] = template
    if config["model_max_length"] is None:
        del config["model_max_length"]
    return tok.to_str(), config


def generation_config(header: "GGUFHeader") -> dict[str, Any]:
    """generation_config.json fields (bos, eos incl. end-of-turn control tokens, pad) from the metadata."""
    meta = header.metadata
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    eos: list[int] = []
    for k in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = meta.get(f"tokenizer.ggml.{k}")
        if isinstance(v, int) and v not in eos:
            eos.append(v)
    for text in _END_OF_TURN_TOKENS:
        try:
            i = tokens.index(text)
        except ValueError:
            continue
        if i < len(types) and types[i] == _TOKEN_CONTROL and i not in eos:
            eos.append(i)
    out: dict[str, Any] = {}
    if isinstance(meta.get("tokenizer.ggml.bos_token_id"), int):
        out["bos_token_id"] = meta["tokenizer.ggml.bos_token_id"]
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if isinstance(meta.get("tokenizer.ggml.padding_token_id"), int):
        out["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return out
