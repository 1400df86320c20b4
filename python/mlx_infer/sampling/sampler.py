"""The sampler: processors, log-softmax, filters, then argmax or a categorical draw.

Each request owns a :class:`RequestRNG` whose key sequence depends only on its
seed and its own step count, so a request's tokens do not depend on what else
runs beside it. :func:`make_sampler` composes the active pure functions of
:mod:`.processors` and :mod:`.filters` once; a step runs only those.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import mlx.core as mx

from ..errors import MlxInferError
from .filters import LogitsFilter, log_softmax, make_filters
from .params import MAX_SEED, MIN_TEMPERATURE, SamplingParams
from .processors import History, LogitsProcessor, make_logits_processors

_EVAL_EVERY = 512  # bounds the lazy graph while fast-forwarding a key sequence
#: The most steps :meth:`RequestRNG.from_state` fast-forwards by default (about 10 s of splits on a CPU).
MAX_RNG_STEPS = 1 << 20


class RNGState(NamedTuple):
    """Where a :class:`RequestRNG` stands: its seed and how many keys it has handed out."""

    seed: int
    steps: int
    explicit: bool = True


class RequestRNG:
    """A per-request key sequence: step n draws with the n-th split of ``key(seed)``.

    Args:
        seed: an explicit seed reproduces; ``None`` picks a fresh one (kept in ``seed``).
    """

    def __init__(self, seed: int | None = None):
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
            raise MlxInferError(f"seed must be a non-negative integer below 2**64, got {seed!r}.")
        self.explicit = seed is not None
        self.seed = seed if seed is not None else secrets.randbits(63)
        self._key = mx.random.key(self.seed)
        self.steps = 0

    def next_key(self) -> mx.array:
        """The key for the next draw; advances the sequence."""
        self._key, sub = mx.random.split(self._key)
        self.steps += 1
        return sub

    def state(self) -> RNGState:
        """``(seed, steps, explicit)``: enough for :meth:`from_state` to resume exactly here."""
        return RNGState(self.seed, self.steps, self.explicit)

    @classmethod
    def from_state(cls, state: RNGState | Sequence[Any] | Mapping[str, Any], *,
                   max_steps: int = MAX_RNG_STEPS) -> "RequestRNG":
        """A sequence positioned after ``state.steps`` keys: its next key is the one an
        uninterrupted run would draw next. Accepts an :class:`RNGState`, a
        ``(seed, steps[, explicit])`` tuple/list (as JSON returns it) or a mapping.

        Reaching step n takes n splits (the key chain cannot be jumped), so
        ``steps`` is refused above ``max_steps`` (what the caller's run can have
        drawn; default :data:`MAX_RNG_STEPS`) rather than looped over.

        Raises:
            MlxInferError: a malformed state, a bad seed, or too many steps.
        """
        try:
            if isinstance(state, Mapping):
                seed, steps, explicit = state["seed"], state["steps"], state.get("explicit", True)
            else:
                seed, steps, *rest = state
                if len(rest) > 1:
                    raise ValueError
                explicit = rest[0] if rest else True
        except (KeyError, TypeError, ValueError):
            raise MlxInferError(f"RNG state must be (seed, steps[, explicit]), got {state!r}.") from None
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise MlxInferError(f"RNG state steps must be a non-negative integer, got {steps!r}.")
        if steps > max_steps:
            raise MlxInferError(f"RNG state steps {steps} exceeds the most this run can have drawn ({max_steps}).")
        if not isinstance(explicit, bool):
            raise MlxInferError(f"RNG state explicit must be True or False, got {explicit!r}.")
        if isinstance(seed, int) and not isinstance(seed, bool) and seed > MAX_SEED:
            raise MlxInferError(f"RNG seed must be at most {MAX_SEED}, got {seed}.")
        rng = cls(seed)
        rng.explicit = explicit
        key = rng._key
        for i in range(steps):
            key = mx.random.split(key)[0]
            if (i + 1) % _EVAL_EVERY == 0:
                mx.eval(key)
        rng._key, rng.steps = key, steps
        return rng


def sample(logits: mx.array, *, temperature: float, rng: RequestRNG | None = None) -> mx.array:
    """Pick next tokens from ``logits`` ``(B, vocab)``; returns ``(B,)`` uint32.

    Args:
        temperature: 0 (or below :data:`~.params.MIN_TEMPERATURE`) means argmax;
            positive values scale logits before a categorical draw.
        rng: the request's key sequence (needed when ``temperature > 0``).
    """
    if not temperature >= 0:  # also refuses NaN
        raise MlxInferError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if temperature < MIN_TEMPERATURE:
        return mx.argmax(logits, axis=-1)
    if rng is None:
        raise MlxInferError("sampling with temperature > 0 needs a RequestRNG.")
    return mx.random.categorical(logits * (1.0 / temperature), key=rng.next_key())


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """One step's result. Shapes are ``(B, ...)``, or without ``B`` for ``(V,)`` logits.

    Attributes:
        token: the chosen ids (B,), uint32.
        logprobs: log-softmax of the processed logits (B, V): after processors,
            before filters and temperature; ``None`` unless ``params.logprobs``.
        token_logprob: ``logprobs`` at ``token`` (B,).
        top_ids: the ``top_logprobs`` most likely ids (B, n), most likely first.
        top_logprobs: their log-probabilities (B, n).
        forced: a constraint forced the token (committed without sampling: no key drawn,
            logprob 0, the token its only top entry).
    """

    token: mx.array
    logprobs: mx.array | None = None
    token_logprob: mx.array | None = None
    top_ids: mx.array | None = None
    top_logprobs: mx.array | None = None
    forced: bool = False


class Sampler:
    """Turns a step's logits into tokens for one request. Build with :func:`make_sampler`.

    Calling it returns the tokens; when ``params.logprobs`` it also records the
    step's :class:`SampleOutput` in ``last``. :meth:`step` returns that output.

    Attributes:
        argmax_only: greedy with no processors and no logprobs: a step is the argmax of the
            logits and nothing else (the engine takes it from one argmax over the batch).
    """

    __slots__ = ("params", "processors", "filters", "last", "argmax_only", "_greedy", "_inv_temp",
                 "_logprobs", "_top_n", "_filter_key", "_vocab")

    def __init__(self, params: SamplingParams, processors: Sequence[LogitsProcessor],
                 filters: Sequence[LogitsFilter], *, filter_needs_key: bool):
        self.params = params
        self.processors = tuple(processors)
        # Greedy picks the argmax, which top_p/min_p/top_k always keep; XTC is skipped.
        self.filters = () if params.greedy else tuple(filters)
        self.last: SampleOutput | None = None
        self.argmax_only = params.greedy and not self.processors and not params.logprobs
        self._greedy = params.greedy
        self._inv_temp = 0.0 if params.greedy else 1.0 / params.temperature
        self._logprobs = params.logprobs
        self._top_n = params.top_logprobs if params.logprobs else 0
        self._filter_key = filter_needs_key and not params.greedy
        self._vocab: int | None = None

    def __call__(self, logits: mx.array, history: History = (), rng: RequestRNG | None = None) -> mx.array:
        """Next tokens: ``(B,)`` for ``(B, V)`` logits, a scalar for ``(V,)``.

        Args:
            logits: the step's raw logits.
            history: the request's tokens so far (prompt + generated); the
                penalties look at their windows of it.
            rng: the request's key sequence (not used, and may be ``None``, when greedy).
        """
        out = self.step(logits, history, rng)
        if self._logprobs:
            self.last = out
        return out.token

    def step(self, logits: mx.array, history: History = (), rng: RequestRNG | None = None, *,
             bitmask: Any = None) -> SampleOutput:
        """Like calling the sampler, but returns the whole :class:`SampleOutput`.

        Args:
            bitmask: the constraint stage: ``(B, words)`` int32 allowed-token bits (see
                :mod:`mlx_infer.constraints`); disallowed tokens get -inf before the processors.
        """
        squeeze = logits.ndim == 1
        x = logits[None] if squeeze else logits  # (B, V)
        if bitmask is not None:
            from ..constraints.mask import apply_bitmask

            x = apply_bitmask(x, bitmask)  # (B, V)
        x = self._process(x, history)  # (B, V)
        if self._greedy:
            token = mx.argmax(x, axis=-1)  # (B,)
            lp = log_softmax(x) if self._logprobs else None
        else:
            lp = log_softmax(x)
            filtered, key = self._filter(lp, rng)
            token = mx.random.categorical(filtered * self._inv_temp, key=key)  # (B,)
        if not self._logprobs:
            return SampleOutput(token[0] if squeeze else token)
        return self._with_logprobs(token, lp, squeeze)

    def filtered_logprobs(self, logits: mx.array, history: History = (),
                          rng: RequestRNG | None = None) -> mx.array:
        """The distribution a draw samples from, before temperature: processed,
        log-softmaxed and filtered (greedy: not filtered). Consumes one key of
        ``rng`` exactly as a call does, so a copy of the RNG reproduces a call's view."""
        squeeze = logits.ndim == 1
        lp = log_softmax(self._process(logits[None] if squeeze else logits, history))
        if not self._greedy:
            lp, _ = self._filter(lp, rng)
        return lp[0] if squeeze else lp

    def _process(self, x: mx.array, history: History) -> mx.array:
        if self._vocab != x.shape[-1]:
            self.params.validate(x.shape[-1])
            self._vocab = x.shape[-1]
        for proc in self.processors:
            x = proc(x, history)
        return x

    def _filter(self, lp: mx.array, rng: RequestRNG | None) -> tuple[mx.array, mx.array]:
        if rng is None:
            raise MlxInferError("sampling with temperature > 0 needs a RequestRNG.")
        key = rng.next_key()
        filter_key = None
        if self._filter_key:
            filter_key, key = mx.random.split(key)
        for f in self.filters:
            lp = f(lp, filter_key)
        return lp, key

    def _with_logprobs(self, token: mx.array, lp: mx.array, squeeze: bool) -> SampleOutput:
        token_lp = mx.take_along_axis(lp, token[:, None].astype(mx.int32), axis=-1)[:, 0]  # (B,)
        top_ids = top_lp = None
        n = min(self._top_n, lp.shape[-1])
        if n > 0:
            ids = mx.argpartition(-lp, kth=n - 1, axis=-1)[..., :n]  # (B, n) unordered
            vals = mx.take_along_axis(lp, ids, axis=-1)
            order = mx.argsort(-vals, axis=-1)
            top_ids = mx.take_along_axis(ids, order, axis=-1)
            top_lp = mx.take_along_axis(vals, order, axis=-1)
        if squeeze:
            token, lp, token_lp = token[0], lp[0], token_lp[0]
            if n > 0:
                top_ids, top_lp = top_ids[0], top_lp[0]
        return SampleOutput(token, lp, token_lp, top_ids, top_lp)


def make_sampler(params: SamplingParams, *, eos_token_ids: Sequence[int] = (),
                 newline_token_ids: Sequence[int] = (), vocab_size: int | None = None) -> Sampler:
    """Compose the active processors and filters of ``params`` into a :class:`Sampler`.

    Args:
        params: the request's sampling parameters.
        eos_token_ids: end tokens; XTC never removes them.
        newline_token_ids: newline tokens; XTC never removes them.
        vocab_size: when known, logit-bias ids are checked now (else on the first call).
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"make_sampler needs SamplingParams, got {type(params).__name__}.")
    params.validate(vocab_size)
    protected = tuple(eos_token_ids) + tuple(newline_token_ids)
    filters = make_filters(params, protected_token_ids=protected)
    needs_key = 0.0 < params.xtc_probability < 1.0
    return Sampler(params, make_logits_processors(params), filters, filter_needs_key=needs_key)
