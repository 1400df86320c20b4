"""What clients send beyond the two completion routes (vLLM's names and semantics).

* ``POST /tokenize``: ``{"prompt": str, "add_special_tokens": bool}`` or ``{"messages": [...],
  "add_generation_prompt": bool, "chat_template_kwargs": {...}}`` -> ``{"count", "max_model_len",
  "tokens"}``.
* ``POST /detokenize``: ``{"tokens": [int]}`` -> ``{"prompt": str}``.
* CORS (:func:`add_cors`): off unless origins are given (``--allowed-origins``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from . import protocol as P

_STRICT = ConfigDict(strict=True, extra="forbid")


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as template variables; the names the server sets itself are refused."""
    kwargs = dict(kwargs or {})
    taken = sorted({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} & set(kwargs))
    if taken:
        raise P.OpenAIError(400, f"chat_template_kwargs must not set {', '.join(taken)} (the server sets it).",
                            param="chat_template_kwargs", code="invalid_value")
    return kwargs


def add_token_routes(app: Any, engine: Any, check_model: Callable[[str], None]) -> None:
    """``/tokenize`` and ``/detokenize`` over the engine's tokenizer."""
    tokenizer = engine.tokenizer
    vocab = engine.vocab_size

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        if req.model is not None:
            check_model(req.model)
        P.check_text(req.model_dump(), "")
        if (req.prompt is None) == (req.messages is None):
            raise P.OpenAIError(400, "give either prompt or messages.", param="prompt", code="invalid_value")
        if req.prompt is not None:
            ids = await asyncio.to_thread(tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            messages = P.chat_messages(req.messages or [])
            try:
                ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages,
                                              add_generation_prompt=req.add_generation_prompt,
                                              **template_kwargs(req.chat_template_kwargs))
            except P.OpenAIError:
                raise
            except Exception as e:  # the template refused these messages
                raise P.OpenAIError(400, f"The chat template rejected these messages: {e}", param="messages",
                                    code="invalid_value") from None
        return {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        if req.model is not None:
            check_model(req.model)
        bad = next((t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise P.OpenAIError(400, f"token id {bad} is outside this model's vocabulary [0, {vocab}).",
                                param="tokens", code="invalid_value")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens)}


def add_cors(app: Any, origins: tuple[str, ...]) -> None:
    """Answer cross-origin requests from ``origins`` (``("*",)``: any); nothing when empty."""
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"],
                       allow_credentials="*" not in origins)
