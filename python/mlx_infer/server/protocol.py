"""The OpenAI wire format: request bodies (pydantic), errors, and response objects.

Request models check types strictly (a wrong type is a 422: ``"max_tokens": "10"``
or ``true`` are not coerced) and reject unknown fields (400, in OpenAI's words:
"Unrecognized request argument supplied"); value rules live in
:class:`~mlx_infer.sampling.SamplingParams`, :func:`sampling_from` and the
checks here, whose errors become 400s. Extensions beyond the OpenAI fields (as
mlx_lm.server and vLLM accept them): ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``skip_special_tokens``,
``spaces_between_special_tokens``, ``prompt_logprobs`` (vLLM's: server/prompt_logprobs.py),
and the structured-output fields (``structured_outputs``, ``guided_*``, ``grammar``,
``json_schema``: server/structured.py).
"""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ..errors import MlxInferError
from ..sampling import SamplingParams

MAX_STOP_STRINGS = 16
#: Most choices (``n``) a request may ask for, and most prompts a completion may batch.
MAX_N = 16
#: Most ``prompt_logprobs`` alternatives per prompt token (vLLM's default ``max_logprobs``; the engine's bound).
MAX_PROMPT_LOGPROBS = 20
#: Most ``logit_bias`` entries a request may carry (OpenAI documents none; 1024 covers real use).
MAX_LOGIT_BIAS = 1024
#: ``logit_bias`` values, as OpenAI bounds them.
LOGIT_BIAS_RANGE = (-100.0, 100.0)
#: ``presence_penalty`` / ``frequency_penalty``, as OpenAI bounds them.
PENALTY_RANGE = (-2.0, 2.0)
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only ("²".isdigit() is true, int("²") fails)
_STRICT = ConfigDict(strict=True, extra="forbid")


class OpenAIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: the usage so far in every chunk


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = _STRICT

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
    response_format: dict[str, Any] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True  # vLLM's: special tokens add no text unless false
    spaces_between_special_tokens: bool | None = True  # vLLM's (see input/tokenizer.py StreamingDetokenizer)
    adapter: str | None = None  # a loaded adapter (server/adapters.py); "model": NAME does the same
    # structured output (see server/structured.py): vLLM's and llama.cpp's fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    prompt_logprobs: int | None = None  # vLLM's: score the prompt (see prompt_logprobs_of)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # image parts carry more keys: rejected by type
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message. The keys an SDK's own response objects carry (``refusal``,
    ``tool_calls``...) are accepted as ``null`` so a reply can be sent back as is."""

    model_config = _STRICT
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False


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
    """Reject what this server does not do (suffix, best_of > 1, ...) with a 400 naming the field."""
    check_text(req.model_dump(), "")
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise _bad(f"n must be in 1..{MAX_N}, got {req.n}.", "n")
    if isinstance(req, CompletionRequest):
        if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
            raise _bad("max_tokens: 0 only scores the prompt, so it needs echo: true (with logprobs for the "
                       "prompt's logprobs) or prompt_logprobs; otherwise give max_tokens >= 1.", "max_tokens")
        if req.suffix:
            raise _bad("suffix is not supported.", "suffix")
        if req.best_of not in (None, 1):
            raise _bad(f"best_of must be 1, got {req.best_of}.", "best_of")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options is only allowed with stream: true.", "stream_options")
    for name, (lo, hi) in (("presence_penalty", PENALTY_RANGE), ("frequency_penalty", PENALTY_RANGE)):
        value = getattr(req, name)
        if value is not None and not (math.isfinite(value) and lo <= value <= hi):
            raise _bad(f"{name} must be in [{lo}, {hi}], got {value}.", name)
    if req.top_k is not None and not 0 <= req.top_k < 2**31:
        raise _bad(f"top_k must be in 0..{2**31 - 1} (0 disables), got {req.top_k}.", "top_k")


def check_text(value: Any, path: str) -> None:
    """Every string in a parsed body must be encodable as UTF-8 (JSON can escape a lone
    surrogate, ``"\\ud800"``, that no tokenizer takes): 400 naming where it is."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _bad(f"{path or 'body'}: the text holds a lone UTF-16 surrogate at character {e.start}; "
                       "send valid Unicode (pair surrogates, or drop them).",
                       re.split(r"[.\[]", path)[0] or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, path)
            check_text(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        if all(type(v) is int for v in value):  # token ids: nothing to check (the common long case)
            return
        for i, v in enumerate(value):
            check_text(v, f"{path}[{i}]")


def logit_bias_of(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    """``logit_bias`` keys as token ids: ASCII digits, within the vocabulary; values in [-100, 100]."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(bias)}.", "logit_bias")
    out: dict[int, float] = {}
    lo, hi = LOGIT_BIAS_RANGE
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise _bad(f"logit_bias keys must be token ids written in ASCII digits (at most 10), got {key[:40]!r}.",
                       "logit_bias")
        tok = int(key)
        if vocab_size is not None and tok >= vocab_size:
            raise _bad(f"logit_bias token id {tok} is outside this model's vocabulary [0, {vocab_size}).",
                       "logit_bias")
        if tok in out:
            raise _bad(f"logit_bias lists token id {tok} twice; give each id once.", "logit_bias")
        if not (math.isfinite(value) and lo <= value <= hi):
            raise _bad(f"logit_bias values must be in [{lo:g}, {hi:g}], got {value} for token {tok}.", "logit_bias")
        out[tok] = value
    return out


def max_tokens_of(req: _Sampling, default: int, *, cap: int, prompt_tokens: int, context: int | None) -> int:
    """``max_completion_tokens`` (chat) or ``max_tokens``, else ``default``.

    A given value must be in ``1..cap`` (the server's ``--max-tokens``) and, with
    the prompt, fit the model's context (400 otherwise, as vLLM and OpenAI
    answer). The default is cut to what the context leaves.
    """
    value = getattr(req, "max_completion_tokens", None)
    name = "max_completion_tokens"
    if value is None:
        value, name = req.max_tokens, "max_tokens"
    room = None if context is None else context - prompt_tokens
    if room is not None and room < 1:
        return 1  # the prompt alone does not fit: the engine's PromptTooLongError says so
    if value is None:
        return max(1, min(default, cap, room if room is not None else default))
    if value < 1:
        raise _bad(f"{name} must be >= 1, got {value}.", name)
    if value > cap:
        raise _bad(f"{name} must be <= {cap} (this server's --max-tokens), got {value}.", name)
    if room is not None and value > room:
        raise OpenAIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                               f"{prompt_tokens + value} tokens ({prompt_tokens} in the prompt, {value} in the "
                               f"completion); lower {name} to at most {max(room, 0)} or shorten the prompt.",
                          param=name, code="context_length_exceeded")
    return value


def sampling_from(req: _Sampling, defaults: dict[str, Any], *, logprobs: bool, top_logprobs: int,
                  vocab_size: int | None = None) -> SamplingParams:
    """:class:`SamplingParams` from the request over the model's generation-config defaults.

    Raises:
        OpenAIError: 400 naming the bad field.
    """
    fields = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
              "seed": req.seed, "repetition_penalty": req.repetition_penalty,
              "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
              "logit_bias": logit_bias_of(req.logit_bias, vocab_size), "logprobs": logprobs,
              "top_logprobs": top_logprobs}
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


def prompt_logprobs_of(req: _Sampling) -> int | None:
    """vLLM's ``prompt_logprobs``: ``k`` asks, for every prompt token, the logprob the model gives it
    after the tokens before it and the ``k`` most likely tokens there (``None`` at the first token).

    Raises:
        OpenAIError: 400 when ``k`` is outside 0..:data:`MAX_PROMPT_LOGPROBS` or the request streams
            (as vLLM: the prompt's scores come with the whole answer).
    """
    k = req.prompt_logprobs
    if k is None:
        return None
    if k == -1:
        raise _bad(f"prompt_logprobs: -1 (the whole vocabulary) is not supported; give 0..{MAX_PROMPT_LOGPROBS}.",
                   "prompt_logprobs")
    if not 0 <= k <= MAX_PROMPT_LOGPROBS:
        raise _bad(f"prompt_logprobs must be in 0..{MAX_PROMPT_LOGPROBS}, got {k}.", "prompt_logprobs")
    if req.stream:
        raise _bad("prompt_logprobs is not available with stream: true (as in vLLM); drop one of them.",
                   "prompt_logprobs")
    return k


def chat_logprobs(req: ChatCompletionRequest) -> tuple[bool, int]:
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise _bad("top_logprobs needs logprobs=true.", "top_logprobs")
    if not 0 <= top <= 20:
        raise _bad(f"top_logprobs must be in 0..20, got {top}.", "top_logprobs")
    return bool(req.logprobs), top


_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (text parts joined; ``developer`` -> ``system``;
    an assistant's ``tool_calls`` and a tool message's ``tool_call_id`` kept)."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise _bad(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {m.role[:40]!r}.", "messages")
        for key in ("function_call", "audio"):
            if getattr(m, key) is not None:
                raise _bad(f"messages[{i}].{key} is not supported (use tool_calls; no audio).", "messages")
        if m.tool_calls is not None and m.role != "assistant":
            raise _bad(f"messages[{i}].tool_calls belongs on an assistant message, not {m.role!r}.", "messages")
        for j, call in enumerate(m.tool_calls or ()):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad(f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", "
                           "\"function\": {\"name\", \"arguments\"}}.", "messages")
        if m.tool_call_id is not None and m.role != "tool":
            raise _bad(f"messages[{i}].tool_call_id belongs on a tool message, not {m.role!r}.", "messages")
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise _bad(f"messages[{i}]: only text content parts are supported.", "messages")
            content = "".join(p.text or "" for p in content)
        role = "system" if m.role == "developer" else m.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if m.tool_calls:
            entry["tool_calls"] = list(m.tool_calls)
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None and role == "tool":
            entry["name"] = m.name
        out.append(entry)
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
    """Engine finish reasons in OpenAI's words; a request cut short (cancelled, failed)
    is ``abort`` (vLLM's word), never ``stop``, which claims a normal end."""
    return {"stop": "stop", "length": "length"}.get(reason or "", "abort" if reason else None)


ChunkKind = Literal["text_completion", "chat.completion.chunk"]
