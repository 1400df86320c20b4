"""One sequence's output, shared by ``generate`` and the engine: the event type, the finish rule, the text.

Both loops hand out :class:`TokenEvent` items (``generate``'s ``GeneratedToken`` is the same class). Each token
gets a tentative finish reason from :func:`token_finish` (``"stop"`` at an end-of-sequence token or a completed
grammar, ``"length"`` at the token limit, ``None`` otherwise; :func:`token_limit` is that limit);
:meth:`TextOutput.feed` turns it into the text to emit and the final reason::

    piece  = detokenizer.flush()  at an end-of-sequence token (its own text is never shown)
             detokenizer.add(t)   otherwise, + detokenizer.flush() when the sequence ends here
    text, stopped = stop_matcher.feed(piece)
    stopped            -> finish "stop" (the text up to the stop string; nothing after it)
    ends here          -> text + stop_matcher.flush() (what was held back as a possible stop prefix)

A cancelled or failed sequence is not fed an ending: what the detokenizer and the matcher hold stays held (a
resumed run re-creates that state and emits it once complete).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .stopping import StopMatcher

ENDINGS = ("stop", "length")


@dataclass(frozen=True, kw_only=True)
class TokenEvent:
    """One generated token of one sequence: what ``generate`` yields and what the engine delivers.

    ``mlx_infer.generation.autoregressive.GeneratedToken`` is this class under its older name (kept for
    compatibility); the engine exports it as ``mlx_infer.engine.TokenEvent``. Fields are keyword-only.

    Attributes:
        token: the generated id; ``None`` only on an engine's final event that carries no token
            (a request cancelled or failed between tokens).
        index: 0 for the first generated token.
        text: the text this token completes (empty while a UTF-8 character or a possible stop
            string is still held back; an end-of-sequence token carries none).
        finish_reason: set on the last event: ``"stop"`` (end-of-sequence token, stop string or a
            completed grammar), ``"length"``, ``"cancelled"`` or (engine) ``"error"``; else ``None``.
        logprob: the token's log-probability under the processed distribution (with
            ``SamplingParams(logprobs=True)``).
        top_logprobs: ``[(id, logprob), ...]`` most likely first (with ``top_logprobs=n``).
        forced: the constraint forced the token (committed without sampling; logprob 0).
        request_id: the engine request the event belongs to; ``None`` from ``generate``.
    """

    token: int | None
    index: int
    text: str = ""
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    forced: bool = False
    request_id: str | None = None


def token_limit(max_tokens: int, prompt_len: int, context_length: int | None) -> int:
    """The most tokens a sequence may generate: ``max_tokens``, and no more than the context window allows
    (the last prompt token's logits give the first token, so a full window still yields one)."""
    if context_length is None:
        return max_tokens
    return min(max_tokens, context_length - prompt_len + 1)


def token_finish(*, eos: bool, complete: bool, count: int, limit: int, cancelled: bool = False) -> str | None:
    """The tentative finish reason of a sequence's ``count``-th generated token (1 for the first).

    ``"stop"`` when the token is an end-of-sequence token (``eos``) or the constraint's grammar is
    ``complete``; else ``"length"`` when ``count`` reached ``limit``; else ``"cancelled"`` when the caller
    ``cancelled``; else ``None``. Stop strings come after, in :meth:`TextOutput.feed`.
    """
    if eos or complete:
        return "stop"
    if count >= limit:
        return "length"
    return "cancelled" if cancelled else None


class TextOutput:
    """Text of one generated sequence, token by token.

    Args:
        detokenizer: a streaming detokenizer (``add(token) -> str``, ``flush() -> str``).
        stop: stop strings; the text ends before the first one found.
    """

    def __init__(self, detokenizer: Any, stop: Iterable[str] = ()):
        self.detokenizer = detokenizer
        self.matcher = StopMatcher(tuple(stop))

    def prime(self, tokens: Iterable[int]) -> None:
        """Bring the state to where it was after ``tokens`` (generated earlier), emitting nothing."""
        for t in tokens:
            self.matcher.feed(self.detokenizer.add(t))

    def feed(self, token: int, finish: str | None, *, eos: bool) -> tuple[str, str | None]:
        """The text ``token`` adds and the finish reason after stop strings.

        Args:
            token: the generated token id.
            finish: the loop's reason to end here (``"stop"``, ``"length"``) or ``None``.
            eos: ``token`` ends the sequence as an end-of-sequence token (its text is dropped).
        """
        ending = finish in ENDINGS
        piece = self.detokenizer.flush() if eos else self.detokenizer.add(token)
        if ending and not eos:
            piece += self.detokenizer.flush()
        text, stopped = self.matcher.feed(piece)
        if stopped:
            return text, "stop"
        if ending:
            text += self.matcher.flush()
        return text, finish
