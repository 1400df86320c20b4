"""The tokenizer of a model directory: ``tokenizers`` JSON + tokenizer_config.json.

Loading uses the ``tokenizers`` library only (no transformers on this path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from ..artifacts.config import read_json_object, read_text
from ..errors import ModelLoadError
from .chat_template import ChatTemplateError, render_chat


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):  # {"content": "<eos>", ...} as older configs write it
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


class Tokenizer:
    """Encode, decode, stream-decode and apply the chat template.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        config: the tokenizer_config.json dict (``chat_template``, ``bos_token``,
            ``eos_token``, ``add_bos_token``).
    """

    def __init__(self, tokenizer: Any, config: dict[str, Any]):
        self._tok = tokenizer
        self.config = config
        self.chat_template: str | None = config.get("chat_template") if isinstance(config.get("chat_template"), str) else None
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)
        self.add_bos_token = bool(config.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS is ensured when the model wants it."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **template_vars: Any) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template; ``template_vars``
        (``tools``, ``chat_template_kwargs``...) are visible to it (``None`` values are left out).
        ``continue_final_message`` ends the text right after the last message's content (what
        follows it, the end-of-turn, is cut) so generation continues that message, as transformers does."""
        if not self.chat_template:
            raise ChatTemplateError(
                "This model has no chat template (neither its tokenizer_config.json nor its GGUF has one: "
                "likely a base model); pass the raw prompt to plain completion instead of chat messages."
            )
        extra = {k: v for k, v in template_vars.items() if v is not None}
        text = render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           **{"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **extra})
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            cut = text.rfind(final) if isinstance(final, str) and final.strip() else -1
            if cut < 0:
                raise ChatTemplateError("continue_final_message: the final message's content does not appear in "
                                        "the rendered template; give the final message non-empty text content.")
            text = text[: cut + len(final)]
        # The template writes BOS itself when the model wants one.
        return self._tok.encode(text, add_special_tokens=False).ids

    def to_json(self) -> str:
        """The ``tokenizers`` JSON of this tokenizer (what structured output's matcher reads)."""
        return self._tok.to_str()

    def added_tokens(self) -> dict[int, str]:
        """``{id: content}`` of the added tokens (special or not), read once."""
        if getattr(self, "_added", None) is None:
            self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        return self._added

    def detokenizer(self, *, skip_special_tokens: bool = False,
                    spaces_between_special_tokens: bool = True) -> "StreamingDetokenizer":
        """A fresh incremental decoder for one generation (``skip_special_tokens``: special
        tokens, the added tokens marked special such as ``<pad>``, add no text;
        ``spaces_between_special_tokens``: see :class:`StreamingDetokenizer`)."""
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens,
                                    spaces_between_special_tokens=spaces_between_special_tokens)


class StreamingDetokenizer:
    """Turn a token stream into text pieces, never splitting a UTF-8 character.

    Each token goes through ``tokenizers``' own incremental decoder (:class:`tokenizers.decoders.DecodeStream`:
    TGI's and vLLM's prefix / read offsets, in Rust): it decodes only a window of the last few tokens, so a
    token costs the same at the start of a generation and 4,000 tokens into it (benchmarks/RESULTS.md, "Session 23:
    the detokenizer": 2-3 us a token on the Gemma 3 tokenizer against 15-52 us for decoding the text since the last
    newline, which grew with the line). The pieces joined are the text of the whole sequence. Should the library
    refuse a step (its ``InvalidPrefix``: a decoder whose text of a window is not a prefix of the next, seen with
    some cleanup rules), this sequence goes on by decoding all of its tokens each time and returning what was
    not returned yet, which is slower but never wrong.

    ``spaces_between_special_tokens`` (vLLM's field and meaning, as its incremental detokenizer
    over a fast tokenizer applies it): ``True`` (default) keeps the text the tokenizer's decoder
    writes; ``False``, with special tokens kept, makes an added token that directly follows
    another added token contribute its content alone, without the space some decoders (none,
    WordPiece, ...) put between tokens. Byte-level and Metaspace decoders put none, so there the
    two agree.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False,
                 spaces_between_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream: Any = DecodeStream(skip_special_tokens=skip_special_tokens)  # None once it refused a step
        self._ids: list[int] = []  # every token fed (the fallback decodes them all)
        self._held: list[int] = []  # tokens fed since the last piece the stream returned
        self._context: list[int] = []  # the tokens of that piece (flush decodes the held ones after them)
        self._returned = 0  # characters returned so far (the fallback's offset)
        # Skipped special tokens add no text, so there is nothing to join (vLLM: the same).
        self._added = None if skip_special_tokens or spaces_between_special_tokens else tokenizer.added_tokens()
        self._last_added = False

    def add(self, token: int) -> str:
        """Feed one token; return the newly complete text (maybe empty)."""
        self._ids.append(token)
        self._held.append(token)
        piece = self._step(token)
        if piece is None:
            piece = ""
        else:
            self._context, self._held = self._held, []
        if self._added is not None:
            content = self._added.get(token)
            if content is not None and self._last_added and piece:
                piece = content  # whatever the decoder put before it is dropped
            self._last_added = content is not None
        self._returned += len(piece)
        return piece

    def _step(self, token: int) -> str | None:
        """The stream's text for ``token`` (``None``: nothing complete yet)."""
        if self._stream is not None:
            try:
                return self._stream.step(self._tokenizer._tok, token)
            except Exception:  # noqa: BLE001 - the library's InvalidPrefix (a plain Exception)
                self._stream = None
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd") or len(text) <= self._returned:
            return None  # an incomplete UTF-8 sequence, or no new text: wait for the next token
        return text[self._returned:]

    def flush(self) -> str:
        """Whatever is still held back (e.g. a dangling partial character)."""
        if not self._held:
            return ""
        if self._stream is None:
            text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)[self._returned:]
        else:  # the held tokens' text after the last piece's tokens (which give it its leading space)
            before = self._tokenizer.decode(self._context, skip_special_tokens=self._skip)
            after = self._tokenizer.decode(self._context + self._held, skip_special_tokens=self._skip)
            text = after[len(before):] if after.startswith(before) else \
                self._tokenizer.decode(self._held, skip_special_tokens=self._skip)
        self._context, self._held = self._context + self._held, []
        self._returned += len(text)
        return text


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """Load ``tokenizer.json`` and ``tokenizer_config.json`` (and ``chat_template.jinja``/``.json``)."""
    from tokenizers import Tokenizer as HFTokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{model_dir} has no tokenizer.json. Copy it from the original checkpoint "
            "(sentencepiece-only tokenizer.model files are not read)."
        )
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own Exception type
        raise ModelLoadError(f"{path} could not be parsed as a tokenizer: {e}") from None
    config = read_json_object(model_dir / "tokenizer_config.json") or {}
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file() and not config.get("chat_template"):
        config["chat_template"] = read_text(jinja)
    extra = read_json_object(model_dir / "chat_template.json")
    if extra is not None and not config.get("chat_template"):
        config["chat_template"] = extra.get("chat_template")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        config["chat_template"] = named.get("default") or next(iter(named.values()), None)
    if config.get("chat_template") is not None and not isinstance(config["chat_template"], str):
        raise ModelLoadError(f"{model_dir}: chat_template must be a string (a Jinja template), got "
                             f"{type(config['chat_template']).__name__}; fix tokenizer_config.json.")
    for key in ("bos_token", "eos_token"):
        if config.get(key) is not None and _token_text(config[key]) is None:
            raise ModelLoadError(f"{model_dir / 'tokenizer_config.json'}: \"{key}\" must be a token string "
                                 f"(or {{\"content\": ...}}), got {config[key]!r}.")
    if not isinstance(config.get("add_bos_token", False), bool):
        raise ModelLoadError(f"{model_dir / 'tokenizer_config.json'}: \"add_bos_token\" must be true or false, "
                             f"got {config['add_bos_token']!r}.")
    return Tokenizer(tok, config)
