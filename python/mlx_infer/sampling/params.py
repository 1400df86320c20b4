"""Validated sampling parameters for one request.

:class:`SamplingParams` is a frozen, keyword-only dataclass. Every value is
checked when it is built, in the float32 terms the sampler computes in; the one check that needs the model (logit-bias ids
inside the vocabulary) is :meth:`SamplingParams.validate`. Bad values raise
:class:`~mlx_infer.errors.MlxInferError` (a ``ValueError``) naming the field,
the allowed range and the value given.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ..errors import MlxInferError

DEFAULT_CONTEXT_SIZE = 20
"""Tokens of history each penalty looks at by default (0 = the whole history)."""

MAX_TOP_LOGPROBS = 20
"""The most alternatives ``top_logprobs`` may ask for (the OpenAI limit)."""

MIN_TEMPERATURE = 1e-6
"""Temperatures in ``(0, MIN_TEMPERATURE)`` sample greedily (argmax), the limit ``T -> 0`` means.

Sampling divides log-probabilities by ``T`` in float32; far below this the quotient
leaves float32's range (``1/T`` itself overflows below ~3e-39) and every token
would tie at ``-inf``, a uniform draw. Above it ``logprobs / T`` stays finite."""

MAX_LOGIT_BIAS = 100.0
"""``|logit_bias[id]|`` bound (OpenAI's): +-100 already forces or bans a token."""

MAX_PENALTY = 100.0
"""``|presence_penalty|`` and ``|frequency_penalty|`` bound: keeps penalised logits finite in float32."""

REPETITION_PENALTY_RANGE = (1e-4, 1e4)
"""``repetition_penalty`` bounds: dividing or multiplying a logit by it stays finite in float32."""

MAX_SEED = 2**64 - 1
"""The largest seed (MLX keys are built from an unsigned 64-bit integer)."""

MAX_TOKEN_ID = 2**31 - 1
"""The largest token id a ``logit_bias`` key may name (MLX indexes with int32)."""

_F32_MAX = 3.4028234663852886e38
_TOKEN_ID = re.compile(r"^-?[0-9]+$")

# generation_config.json keys we take defaults from.
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _fail(name: str, rule: str, value: Any) -> MlxInferError:
    return MlxInferError(f"SamplingParams.{name} must be {rule}, got {value!r}.")


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(name, "a number", value)
    value = float(value)
    if not math.isfinite(value):
        raise _fail(name, "a finite number", value)
    if abs(value) > _F32_MAX:  # finite in float64, inf in the float32 the sampler computes in
        raise _fail(name, "a finite number in float32 range (|x| <= 3.4e38)", value)
    return value


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, "an integer", value)
    return int(value)


def _bias_id(key: Any) -> int:
    # JSON objects (the OpenAI API) carry token ids as strings.
    if isinstance(key, str) and _TOKEN_ID.match(key.strip()):
        return int(key.strip())
    if isinstance(key, bool) or not isinstance(key, int):
        raise MlxInferError(f"SamplingParams.logit_bias keys must be token ids (integers), got {key!r}.")
    return int(key)


@dataclass(frozen=True, kw_only=True, eq=True)
class SamplingParams:
    """How one request turns logits into tokens.

    Disabled values: ``temperature=0`` (greedy), ``top_p=1``, ``min_p=0``,
    ``top_k=0``, ``xtc_probability=0``, ``repetition_penalty=1``,
    ``presence_penalty=0``, ``frequency_penalty=0``, empty ``logit_bias``.

    Args:
        temperature: >= 0; 0 means argmax (filters are then skipped), and so does
            any value below :data:`MIN_TEMPERATURE` (it is stored as 0).
        top_p: nucleus mass in (0, 1]; 1 disables; a value too small for float32
            keeps only the most likely token (what top_p -> 0 means).
        min_p: in [0, 1]; keep tokens with p >= min_p * p_max; 0 disables.
        min_tokens_to_keep: >= 1; tokens min_p never removes.
        top_k: >= 0; keep the k most likely tokens; 0 (or >= vocab) disables.
        xtc_probability: in [0, 1]; chance that XTC applies at a step.
        xtc_threshold: in [0, 0.5]; XTC removes every token with
            p > threshold except the least likely of them.
        logit_bias: token id -> additive bias in [-100, 100] (ids must lie in [0, vocab)).
        repetition_penalty: in [1e-4, 1e4]; divides positive / multiplies negative logits
            of tokens in the window; 1 disables.
        repetition_context_size: >= 0 tokens of history (0 = all).
        presence_penalty: in [-100, 100]; subtracted once from tokens in the window.
        presence_context_size: >= 0 tokens of history (0 = all).
        frequency_penalty: in [-100, 100]; subtracted once per occurrence in the window.
        frequency_context_size: >= 0 tokens of history (0 = all).
        seed: in [0, 2**64) reproduces a request's draws; ``None`` picks a fresh seed.
        logprobs: return the log-probabilities of each step's distribution.
        top_logprobs: 0..20 most likely alternatives to return (needs ``logprobs``).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    repetition_penalty: float = 1.0
    repetition_context_size: int = DEFAULT_CONTEXT_SIZE
    presence_penalty: float = 0.0
    presence_context_size: int = DEFAULT_CONTEXT_SIZE
    frequency_penalty: float = 0.0
    frequency_context_size: int = DEFAULT_CONTEXT_SIZE
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        for f in fields(self):
            if f.type == "float":
                put(f.name, _float(f.name, getattr(self, f.name)))
            elif f.type == "int":
                put(f.name, _int(f.name, getattr(self, f.name)))

        if self.temperature < 0:
            raise _fail("temperature", ">= 0 (0 = greedy)", self.temperature)
        if self.temperature < MIN_TEMPERATURE:
            put("temperature", 0.0)  # see MIN_TEMPERATURE: greedy is what T -> 0 means
        if not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", "in (0, 1] (1 disables nucleus filtering)", self.top_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise _fail("min_p", "in [0, 1] (0 disables)", self.min_p)
        if self.min_tokens_to_keep < 1:
            raise _fail("min_tokens_to_keep", ">= 1", self.min_tokens_to_keep)
        if self.top_k < 0:
            raise _fail("top_k", ">= 0 (0 disables)", self.top_k)
        if not 0.0 <= self.xtc_probability <= 1.0:
            raise _fail("xtc_probability", "in [0, 1] (0 disables)", self.xtc_probability)
        if not 0.0 <= self.xtc_threshold <= 0.5:
            raise _fail("xtc_threshold", "in [0, 0.5]", self.xtc_threshold)
        if self.repetition_penalty <= 0:
            raise _fail("repetition_penalty", "> 0 (1 disables)", self.repetition_penalty)
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise _fail("repetition_penalty", f"in [{lo:g}, {hi:g}] (1 disables)", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(getattr(self, name)) > MAX_PENALTY:
                raise _fail(name, f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 disables)", getattr(self, name))
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            if getattr(self, name) < 0:
                raise _fail(name, ">= 0 (0 = the whole history)", getattr(self, name))
        if self.seed is not None:
            seed = _int("seed", self.seed)
            if not 0 <= seed <= MAX_SEED:
                raise _fail("seed", "a non-negative integer below 2**64, or None", seed)
        if not isinstance(self.logprobs, bool):
            raise _fail("logprobs", "True or False", self.logprobs)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise _fail("top_logprobs", f"in 0..{MAX_TOP_LOGPROBS}", self.top_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise _fail("top_logprobs", "0 unless logprobs=True (set logprobs=True to get alternatives)",
                        self.top_logprobs)

        bias = self.logit_bias if self.logit_bias is not None else {}
        if not isinstance(bias, Mapping):
            raise _fail("logit_bias", "a mapping of token id -> bias", bias)
        clean: dict[int, float] = {}
        for key, value in bias.items():
            tok = _bias_id(key)
            if tok < 0:
                raise MlxInferError(f"SamplingParams.logit_bias token id must be >= 0, got {tok}.")
            if tok > MAX_TOKEN_ID:
                raise MlxInferError(f"SamplingParams.logit_bias token id must be < 2**31, got {tok}.")
            if tok in clean:
                raise MlxInferError(f"SamplingParams.logit_bias lists token id {tok} twice "
                                    f"(as {key!r} and another key); give each id once.")
            clean[tok] = _float(f"logit_bias[{tok}]", value)
            if abs(clean[tok]) > MAX_LOGIT_BIAS:
                raise _fail(f"logit_bias[{tok}]", f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", value)
        put("logit_bias", clean)  # a private copy (kept a dict so params pickle and deepcopy)

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Check what needs the model: logit-bias ids must lie in ``[0, vocab_size)``.

        Returns ``self`` so it can be chained.
        """
        if vocab_size is not None and self.logit_bias:
            bad = sorted(t for t in self.logit_bias if t >= vocab_size)
            if bad:
                raise MlxInferError(
                    f"SamplingParams.logit_bias token ids must be in [0, {vocab_size}) for this "
                    f"model's vocabulary, got {bad[:5]}{'...' if len(bad) > 5 else ''}.")
        return self

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (``temperature == 0``)."""
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (``logit_bias`` as sorted ``[id, bias]`` pairs)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["logit_bias"] = [[t, b] for t, b in sorted(self.logit_bias.items())]
        return out

    @classmethod
    def from_generation_config(cls, cfg: Mapping[str, Any] | None, **overrides: Any) -> "SamplingParams":
        """Defaults from a model's ``generation_config.json``, then ``overrides``.

        Reads ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
        ``repetition_penalty``; ``do_sample: false`` means temperature 0. A
        missing or ``null`` key keeps the class default; ``top_p`` of 0 (some
        configs write it for "off") becomes 1. Overrides whose value is
        ``None`` are ignored, so CLI flags left unset fall through.
        """
        cfg = dict(cfg or {})
        values: dict[str, Any] = {}
        for key in _GENERATION_CONFIG_KEYS:
            if cfg.get(key) is not None:
                values[key] = cfg[key]
        if values.get("top_p") == 0:
            values["top_p"] = 1.0
        if cfg.get("do_sample") is False:
            values["temperature"] = 0.0
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise MlxInferError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}.")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
