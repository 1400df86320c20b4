"""One request's live constraint: an llguidance ``LLMatcher`` over the model's vocabulary.

:func:`constraint_tokenizer` wraps a model's tokenizer once (llguidance builds a token trie,
~1 s for a 256k vocabulary) and caches it. :class:`ConstraintState` is what the generation loop
drives: after each committed token it :meth:`~ConstraintState.advance`\\ s, asks for the
:meth:`~ConstraintState.forced` tokens (the grammar admits exactly one continuation: keys,
punctuation, the rest of a choice), or fills the next step's allowed-token bitmask.
:func:`fill_bitmasks` computes the masks of many requests at once on llguidance's thread pool.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

import numpy as np

from .spec import Constraint, ConstraintError, _llguidance, one_line

_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict[tuple, Any]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_EXECUTOR: Any = None


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask (one bit per token)."""
    return (vocab_size + 31) // 32


def constraint_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """The ``llguidance.LLTokenizer`` for ``tokenizer`` (an :class:`mlx_infer.input.tokenizer.Tokenizer`),
    sized to the model's ``vocab_size`` (its logits width; ids past the tokenizer's are never allowed)."""
    llg = _llguidance()
    eos = sorted({int(t) for t in eos_token_ids})
    key = (int(vocab_size), tuple(eos))
    with _LOCK:
        per = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in per:
            try:
                per[key] = llg.LLTokenizer(tokenizer.to_json(), n_vocab=int(vocab_size),
                                           eos_token=eos or None)
            except (ValueError, RuntimeError) as e:
                raise ConstraintError(f"structured output cannot use this model's tokenizer: {one_line(str(e))}") from None
        return per[key]


def _executor() -> Any:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = _llguidance().LLExecutor()
    return _EXECUTOR


class ConstraintState:
    """The matcher of one generation. Build with :meth:`create`.

    Attributes:
        constraint: what it enforces.
        vocab_size: the logits width masks cover.
        forced_committed: tokens committed because the grammar forced them.
    """

    def __init__(self, constraint: Constraint, matcher: Any, vocab_size: int):
        self.constraint = constraint
        self._m = matcher
        self.vocab_size = vocab_size
        self.forced_committed = 0
        self._forced: list[int] | None = None  # forced() since the last advance (cleared by it)
        self._bitmask = np.full((1, bitmask_words(vocab_size)), -1, dtype=np.int32)

    @classmethod
    def create(cls, constraint: Constraint, tokenizer: Any, vocab_size: int,
               eos_token_ids: Sequence[int]) -> "ConstraintState":
        """Compile ``constraint`` against the model's tokenizer.

        Raises:
            ConstraintError: llguidance refused the grammar (the message says why).
        """
        if not isinstance(constraint, Constraint):
            raise ConstraintError(f"constraint must be a Constraint (see mlx_infer.constraints), "
                                  f"got {type(constraint).__name__}.")
        llg = _llguidance()
        tok = constraint_tokenizer(tokenizer, vocab_size, eos_token_ids)
        matcher = llg.LLMatcher(tok, constraint.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"the {constraint.kind.replace('_', ' ')} constraint was refused: "
                                  f"{one_line(matcher.get_error())}")
        return cls(constraint, matcher, vocab_size)

    # -- state -----------------------------------------------------------------------

    @property
    def matcher(self) -> Any:
        """The ``llguidance.LLMatcher``."""
        return self._m

    @property
    def done(self) -> bool:
        """The grammar admits no more text (only EOS could follow)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (the output may end here)."""
        return self._m.is_accepting()

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (empty when the model has a choice). Computed once per
        state (the engine asks after each token and again when it samples): treat as read-only."""
        if self._forced is None:
            self._forced = [] if self._m.is_stopped() else list(self._m.compute_ff_tokens())
        return self._forced

    def advance(self, token: int, *, forced: bool = False) -> None:
        """Commit ``token``; it must be one the last mask allowed.

        Raises:
            ConstraintError: the matcher refused the token (a bug upstream: the mask allowed it).
        """
        self._forced = None
        if not self._m.consume_token(int(token)):
            raise ConstraintError(f"the constraint refused token {token}: {self._m.get_error()}")
        if forced:
            self.forced_committed += 1

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` committed tokens (llguidance's rollback; forced ones stay counted).

        Raises:
            ConstraintError: the matcher cannot go back that far.
        """
        self._forced = None
        if not self._m.rollback(int(n)):
            raise ConstraintError(f"the constraint cannot roll back {n} tokens: {self._m.get_error()}")

    def bitmask(self) -> np.ndarray:
        """This step's allowed tokens as ``(1, words)`` int32 bits (bit ``t % 32`` of word ``t // 32``)."""
        self._m.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if self._m.is_error():
            raise ConstraintError(f"the constraint failed: {self._m.get_error()}")
        return self._bitmask


def fill_bitmasks(states: Sequence[ConstraintState | None], out: np.ndarray | None = None) -> np.ndarray:
    """Masks of a batch ``(B, words)`` int32, computed in parallel; rows without a state allow everything.

    Args:
        states: one entry per row (``None``: unconstrained); all states share one vocab size.
        out: a C-contiguous ``(B, words)`` int32 buffer to fill (allocated when ``None``).
    """
    vocab = next((s.vocab_size for s in states if s is not None), 32)
    words = bitmask_words(vocab)
    if out is None:
        out = np.empty((len(states), words), dtype=np.int32)
    out.fill(-1)
    work = [(s.matcher, i) for i, s in enumerate(states) if s is not None]
    if len(work) == 1:
        i = work[0][1]
        out[i] = states[i].bitmask()[0]
    elif work:
        _executor().unsafe_compute_mask_ptr(work, out.ctypes.data, words * 4, len(states))
    return out
