"""One sequence's text output: detokenizer + stop strings + the finish rule, shared by ``generate`` and the engine.

Both loops produce tokens with a tentative finish reason (``"stop"`` at an end-of-sequence token or a completed
grammar, ``"length"`` at the token limit, ``None`` otherwise); :meth:`TextOutput.feed` turns each into the text to
emit and the final reason::

    piece  = detokenizer.flush()  at an end-of-sequence token (its own text is never shown)
             detokenizer.add(t)   otherwise, + detokenizer.flush() when the sequence ends here
    text, stopped = stop_matcher.feed(piece)
    stopped            -> finish "stop" (the text up to the stop string; nothing after it)
    ends here          -> text + stop_matcher.flush() (what was held back as a possible stop prefix)

A cancelled or failed sequence is not fed an ending: what the detokenizer and the matcher hold stays held (a
resumed run re-creates that state and emits it once complete).
"""

from __future__ import annotations

from typing import Any, Iterable

from .stopping import StopMatcher

ENDINGS = ("stop", "length")


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
