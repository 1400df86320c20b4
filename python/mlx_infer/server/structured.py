"""Structured-output fields of a request -> one :class:`~mlx_infer.constraints.Constraint`.

Accepted, with vLLM's and llama.cpp's names and meanings:

* OpenAI ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}``.
  Any other type is a 400 naming it (never silently ignored).
* vLLM ``structured_outputs``: ``{"json": schema | "…", "regex": "…", "choice": [...],
  "grammar": "…", "json_object": true}`` (one key), and the older top-level ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``.
* llama.cpp ``grammar`` (GBNF or Lark text) and ``json_schema`` (a schema object).

At most one of them may be given. A schema llguidance cannot compile is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from ..constraints import Constraint, ConstraintError
from .protocol import OpenAIError

#: Request fields that carry a constraint.
FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "grammar", "json_schema")

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def _response_format(rf: dict[str, Any]) -> Constraint | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad('response_format.json_schema must be an object {"name": ..., "schema": {...}} '
                       "when type is json_schema.", "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise _bad("response_format.json_schema.schema is missing: give the JSON Schema there.",
                       "response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"response_format.json_schema.strict must be true or false, got {strict!r}.",
                       "response_format")
        return Constraint.json_schema(schema)  # always enforced exactly, strict or not
    raise _bad(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
               "response_format")


def _structured_outputs(so: Any) -> Constraint | None:
    if not isinstance(so, dict):
        raise _bad("structured_outputs must be an object with one of: " + ", ".join(_STRUCTURED_KEYS) + ".",
                   "structured_outputs")
    given = [k for k in _STRUCTURED_KEYS if so.get(k) not in (None, False)]
    unknown = sorted(set(so) - set(_STRUCTURED_KEYS) - {"backend", "disable_any_whitespace",
                                                          "disable_additional_properties", "whitespace_pattern"})
    if unknown:
        raise _bad(f"structured_outputs.{unknown[0]} is not supported; use one of: "
                   + ", ".join(_STRUCTURED_KEYS) + ".", "structured_outputs")
    if len(given) > 1:
        raise _bad(f"structured_outputs takes one constraint, got {', '.join(given)}.", "structured_outputs")
    if not given:
        return None
    key = given[0]
    value = so[key]
    return _of(key, value)


def _of(key: str, value: Any) -> Constraint:
    if key == "json":
        return Constraint.json_schema(value)
    if key == "json_object":
        return Constraint.json_object()
    if key == "regex":
        return Constraint.regex(value)
    if key == "choice":
        return Constraint.choice(value)
    if not isinstance(value, str):
        raise ConstraintError(f"a grammar must be text (Lark or GBNF), got {type(value).__name__}.")
    return Constraint.grammar(value)


def constraint_of(req: Any) -> Constraint | None:
    """The request's constraint, compiled once to check it, or ``None``.

    Raises:
        OpenAIError: 400 naming the field when two are given, a type is unsupported, or the
            schema/regex/grammar is malformed.
    """
    present = [f for f in FIELDS if getattr(req, f, None) is not None]
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.get("type") == "text":
        present.remove("response_format")  # plain text: no constraint, combinable with nothing else
    if len(present) > 1:
        raise _bad(f"give one structured-output field, got {', '.join(present)}.", present[1])
    if not present:
        return None
    field = present[0]
    value = getattr(req, field)
    try:
        if field == "response_format":
            c = _response_format(value)
        elif field == "structured_outputs":
            c = _structured_outputs(value)
        elif field == "json_schema":
            c = Constraint.json_schema(value)
        else:
            c = _of(field.removeprefix("guided_"), value)  # guided_json -> json, grammar -> grammar
        return c.validate() if c is not None else None
    except ConstraintError as e:
        raise _bad(f"{field}: {e}", field) from None
