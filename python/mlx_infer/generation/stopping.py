"""When a generation ends: stop strings on streamed text, and cancellation."""

from __future__ import annotations

import threading
from typing import Sequence

from ..errors import MlxInferError


class CancelToken:
    """Cancel a running generation from another thread: ``token.cancel()``.

    The loop checks it before each step; the generation then ends with
    ``finish_reason="cancelled"`` and releases its state.
    """

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        """Ask the generation to stop at its next step."""
        self._event.set()

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._event.is_set()


class StopMatcher:
    """Find stop strings in streamed text, across token boundaries.

    :meth:`feed` returns the text that is safe to emit: text that cannot be
    the start of a stop string. A tail that might begin one is held back until
    the next piece decides; the matched stop string itself is never emitted.
    """

    def __init__(self, stops: Sequence[str] = ()):
        if isinstance(stops, str):
            stops = [stops]
        for s in stops:
            if not isinstance(s, str) or not s:
                raise MlxInferError(f"stop strings must be non-empty strings, got {s!r}.")
        self.stops = tuple(stops)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return ``(emit, stopped)``. After a stop, nothing more is emitted."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:  # longest tail of buf that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release held-back text at the end of a generation that did not stop on a string."""
        held, self._held = self._held, ""
        return held
