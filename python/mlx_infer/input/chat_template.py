"""Render a model's Jinja chat template the way Hugging Face transformers does."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from ..errors import MlxInferError


class ChatTemplateError(MlxInferError):
    """The chat template is missing or failed to render the given messages."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"The model's chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"The model's chat template is not valid Jinja: {e}") from None


def render_chat(template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                **special_tokens: Any) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}]``) with ``template``.

    Args:
        template: the Jinja source (``chat_template`` of tokenizer_config.json or GGUF).
        messages: the conversation.
        add_generation_prompt: end with the assistant turn's opening.
        **special_tokens: ``bos_token``, ``eos_token`` and the like, visible to the template.
    """
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError(f"Message {i} must be a dict with a 'role' and 'content'; got {m!r}.")
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens)
