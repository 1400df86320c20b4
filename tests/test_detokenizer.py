"""The streaming detokenizer (input/tokenizer.py ``StreamingDetokenizer``) that ``generate`` and the engine share.

Its pieces, joined, are the text of the whole sequence (``tokenizers``' own decode) for any tokens, on the tiny
byte-level tokenizer, a SentencePiece-style (Metaspace) one and the real Gemma 3 tokenizer; a dangling partial
character comes out at ``flush``; a step the library refuses falls back to whole decodes without losing text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from mlx_infer.input.tokenizer import Tokenizer
from tiny import make_tokenizer_json

TINY = Tokenizer(HFTokenizer.from_str(make_tokenizer_json()), {})
README = Path(__file__).resolve().parents[1] / "README.md"


def streamed(tok: Tokenizer, ids: list[int], **kw) -> tuple[list[str], str]:
    """The pieces ``add`` returns for ``ids`` and what ``flush`` returns after them."""
    d = tok.detokenizer(**kw)
    pieces = [d.add(t) for t in ids]
    return pieces, d.flush()


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=TINY.vocab_size - 1), max_size=60), skip=st.booleans())
def test_pieces_join_to_the_whole_decode(ids, skip):
    pieces, tail = streamed(TINY, ids, skip_special_tokens=skip)
    assert "".join(pieces) + tail == TINY.decode(ids, skip_special_tokens=skip)


def test_a_dangling_partial_character_comes_out_at_flush():
    # "Ã" and "©" are the bytes 0xC3 0xA9 (é) in the byte-level alphabet: one token each.
    h, lead, cont = (TINY._tok.token_to_id(c) for c in ("H", "Ã", "©"))
    pieces, tail = streamed(TINY, [h, lead])
    assert pieces == ["H", ""] and tail == "\ufffd"  # the lead byte alone is no character yet
    pieces, tail = streamed(TINY, [h, lead, cont])
    assert pieces == ["H", "", "é"] and tail == ""


def metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style word tokenizer: its decoder drops the space of a call's first word."""
    tok = HFTokenizer(models.WordLevel({"<unk>": 0, "▁a": 1, "▁b": 2, "\n": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return Tokenizer(tok, {})


def test_a_word_after_a_newline_keeps_its_space():
    tok = metaspace_tokenizer()
    pieces, tail = streamed(tok, [1, 3, 2])
    # Decoding the text since the last newline (the detokenizer before DecodeStream) gave "a\nb".
    assert pieces == ["a", "\n", " b"] and tail == ""
    assert "".join(pieces) == tok.decode([1, 3, 2]) == "a\n b"


def test_a_refused_step_falls_back_to_whole_decodes():
    ids = TINY.encode("Hello world! This is a tiny tokenizer for tests. é ü", add_special_tokens=False)
    d = TINY.detokenizer()
    first = [d.add(t) for t in ids[:5]]

    class Refusing:
        def step(self, tokenizer, token):
            raise Exception("InvalidPrefix")  # what tokenizers raises: a plain Exception

    d._stream = Refusing()
    rest = [d.add(t) for t in ids[5:]]
    assert d._stream is None  # switched for the rest of the sequence
    assert "".join(first + rest) + d.flush() == TINY.decode(ids)


def test_the_special_token_rule_still_applies():
    added = TINY.added_tokens()
    assert len(added) >= 2, "the tiny tokenizer has added tokens"
    ids = list(added)[:2]
    kept, tail = streamed(TINY, ids, spaces_between_special_tokens=False)
    assert "".join(kept) + tail == "".join(added[i] for i in ids)


@pytest.mark.slow
def test_the_real_tokenizer_streams_the_whole_decode(real_model):
    tok = real_model.tokenizer
    rng = random.Random(0)
    for _ in range(4):  # random ids: byte-fallback pieces, special tokens, anything the model could sample
        ids = [rng.randrange(tok.vocab_size) for _ in range(300)]
        for skip in (False, True):
            pieces, tail = streamed(tok, ids, skip_special_tokens=skip)
            assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
    text = README.read_text() + json.dumps({"ü": "日本語 🙂", "x": [1, 2]})
    ids = tok.encode(text, add_special_tokens=False)
    pieces, tail = streamed(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) and tail == ""
