"""The OpenAI wire format: request bodies (pydantic), errors, and response objects.

Request models check types only (a wrong type is a 422); value rules live in
:class:`~mlx_infer.sampling.SamplingParams` and :func:`sampling_from`, whose
errors become 400s, so every bad value gets the same message the library
gives. Extensions beyond the OpenAI fields (as mlx_lm.server and vLLM accept
them): ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ..errors import MlxInferError
from ..sampling import SamplingParams

MAX_STOP_STRINGS = 16


class OpenAIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = False


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None


# -- request -> engine ------------------------------------------------------------


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """The request's stop strings (at most :data:`MAX_STOP_STRINGS`, each non-empty)."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}.", "stop")
    if any(not s for s in stops):
        raise _bad("stop strings must be non-empty.", "stop")
    return tuple(stops)


def check_common(req: _Sampling) -> None:
    """Reject what this server does not do (n > 1, ...) with a 400 naming the field."""
    if req.n is not None and req.n != 1:
        raise _bad(f"n must be 1 (this server returns one choice per request), got {req.n}.", "n")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise _bad("echo is not supported.", "echo")
        if req.suffix:
            raise _bad("suffix is not supported.", "suffix")
        if req.best_of not in (None, 1):
            raise _bad(f"best_of must be 1, got {req.best_of}.", "best_of")
    if isinstance(req, ChatCompletionRequest) and req.tools:
        raise _bad("tools are not supported.", "tools")


def max_tokens_of(req: _Sampling, default: int) -> int:
    """``max_completion_tokens`` (chat) or ``max_tokens``, else ``default``; must be >= 1."""
    value = getattr(req, "max_completion_tokens", None)
    name = "max_completion_tokens"
    if value is None:
        value, name = req.max_tokens, "max_tokens"
    if value is None:
        return default
    if value < 1:
        raise _bad(f"{name} must be >= 1, got {value}.", name)
    return value


def sampling_from(req: _Sampling, defaults: dict[str, Any], *, logprobs: bool, top_logprobs: int) -> SamplingParams:
    """:class:`SamplingParams` from the request over the model's generation-config defaults.

    Raises:
        OpenAIError: 400 naming the bad field.
    """
    fields = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
              "seed": req.seed, "repetition_penalty": req.repetition_penalty,
              "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
              "logit_bias": req.logit_bias, "logprobs": logprobs, "top_logprobs": top_logprobs}
    try:
        return SamplingParams.from_generation_config(defaults, **fields)
    except MlxInferError as e:
        param = next((f for f in fields if f"SamplingParams.{f} " in str(e) or f"SamplingParams.{f}[" in str(e)), None)
        raise _bad(str(e), param) from None


def completion_logprobs(req: CompletionRequest) -> tuple[bool, int]:
    if req.logprobs is None:
        return False, 0
    if not 0 <= req.logprobs <= 5:
        raise _bad(f"logprobs must be in 0..5 for completions, got {req.logprobs}.", "logprobs")
    return True, req.logprobs


def chat_logprobs(req: ChatCompletionRequest) -> tuple[bool, int]:
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise _bad("top_logprobs needs logprobs=true.", "top_logprobs")
    if not 0 <= top <= 20:
        raise _bad(f"top_logprobs must be in 0..20, got {top}.", "top_logprobs")
    return bool(req.logprobs), top


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them (text parts joined; ``developer`` -> ``system``)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise _bad(f"messages[{i}]: only text content parts are supported.", "messages")
            content = "".join(p.text or "" for p in content)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content or ""})
    return out


# -- responses -------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class LogprobFormatter:
    """Token strings and the two logprob layouts (legacy completions, chat)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def completion(self, tokens: list[int], lps: list[float], tops: list[list[tuple[int, float]]] | None,
                   offset: int = 0) -> dict[str, Any]:
        strs = [self.text(t) for t in tokens]
        offsets, pos = [], offset
        for s in strs:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": strs, "token_logprobs": lps,
                "top_logprobs": [{self.text(i): lp for i, lp in top} for top in tops] if tops else None,
                "text_offset": offsets}

    def chat(self, tokens: list[int], lps: list[float], tops: list[list[tuple[int, float]]] | None) -> dict[str, Any]:
        content = []
        for k, (t, lp) in enumerate(zip(tokens, lps)):
            s = self.text(t)
            entry: dict[str, Any] = {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
            if tops:
                entry["top_logprobs"] = [{"token": self.text(i), "logprob": v, "bytes": list(self.text(i).encode())}
                                         for i, v in tops[k]]
            content.append(entry)
        return {"content": content}


def finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons in OpenAI's words (a cancelled or failed stream ends as ``stop``)."""
    return {"stop": "stop", "length": "length"}.get(reason or "", "stop" if reason else None)


ChunkKind = Literal["text_completion", "chat.completion.chunk"]
