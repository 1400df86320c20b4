"""What a request constrains its output to: :class:`Constraint`, compiled to an llguidance grammar.

A :class:`Constraint` is a small frozen value (it pickles, hashes and compares), built by one of
its constructors: :meth:`Constraint.json_schema`, :meth:`Constraint.json_object`,
:meth:`Constraint.regex`, :meth:`Constraint.choice` and :meth:`Constraint.grammar` (a Lark
grammar, or llama.cpp GBNF, which llguidance converts). :meth:`Constraint.llguidance_grammar`
turns it into the grammar text llguidance's matcher reads; nothing here needs a model.

JSON output is compact by default (no whitespace between tokens), as vLLM's
``disable_any_whitespace``: free whitespace lets a weak model pad forever.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..errors import MlxInferError

#: The kinds a :class:`Constraint` may have.
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class ConstraintError(MlxInferError):
    """A constraint (schema, regex, choice list or grammar) is malformed or unsupported."""


def one_line(message: str, limit: int = 300) -> str:
    """llguidance's (multi-line, caret-annotated) error as one line of at most ``limit`` characters."""
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip() and set(part.strip()) != {"^"})
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - the structured extra is not installed
        raise ConstraintError("structured output needs llguidance: pip install 'mlx-infer[structured]'.") from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """A constraint on generated text. Build with a constructor, not directly.

    Attributes:
        kind: one of :data:`KINDS`.
        text: the canonical text of the constraint: the schema as JSON,
            the regex, the choices as a JSON list, or the grammar source.
        whitespace_flexible: JSON kinds only; allow any whitespace between JSON tokens.
    """

    kind: str
    text: str
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}.")
        if not isinstance(self.text, str):
            raise ConstraintError(f"constraint text must be a string, got {type(self.text).__name__}.")

    # -- constructors ----------------------------------------------------------------

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool, *, whitespace_flexible: bool = False) -> "Constraint":
        """Output is one JSON value valid under ``schema`` (a dict, its JSON text, or ``True``)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON ({e.msg} at line {e.lineno} "
                                      f"column {e.colno}).") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, Mapping):
            raise ConstraintError(f"a JSON schema must be an object (or true), got {type(schema).__name__}.")
        try:
            text = json.dumps(schema)  # key order kept: properties are generated in schema order
        except (TypeError, ValueError) as e:
            raise ConstraintError(f"the JSON schema cannot be serialized as JSON: {e}.") from None
        return cls("json_schema", text, whitespace_flexible)

    @classmethod
    def json_object(cls, *, whitespace_flexible: bool = False) -> "Constraint":
        """Output is one JSON object (OpenAI ``response_format={"type": "json_object"}``)."""
        return cls("json_object", '{"type": "object"}', whitespace_flexible)

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """The whole output matches ``pattern`` (Rust ``regex`` syntax; anchored at both ends)."""
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError(f"a regex constraint needs a non-empty pattern string, got {pattern!r}.")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Iterable[str]) -> "Constraint":
        """The output is exactly one of ``choices``."""
        if isinstance(choices, str):
            raise ConstraintError("choice needs a list of strings, got a single string; wrap it in a list.")
        try:
            items = list(choices)
        except TypeError:
            raise ConstraintError(f"choice needs a list of strings, got {type(choices).__name__}.") from None
        if not items:
            raise ConstraintError("choice needs at least one string.")
        for c in items:
            if not isinstance(c, str) or not c:
                raise ConstraintError(f"every choice must be a non-empty string, got {c!r}.")
        return cls("choice", json.dumps(items))

    @classmethod
    def grammar(cls, source: str) -> "Constraint":
        """The output is derived from a context-free grammar: Lark syntax (llguidance's,
        start symbol ``start``) or llama.cpp GBNF (start symbol ``root``), told apart by llguidance."""
        if not isinstance(source, str) or not source.strip():
            raise ConstraintError("a grammar constraint needs the grammar's source text (Lark or GBNF).")
        return cls("grammar", source)

    # -- compile ----------------------------------------------------------------------

    @property
    def is_json(self) -> bool:
        """Whether the output is a JSON value (schema or object mode)."""
        return self.kind in ("json_schema", "json_object")

    def llguidance_grammar(self) -> str:
        """The llguidance grammar text for this constraint (not yet checked against a tokenizer).

        Raises:
            ConstraintError: the text cannot be converted (e.g. a GBNF grammar that fails to parse).
        """
        llg = _llguidance()
        if self.is_json:
            options = {"whitespace_flexible": self.whitespace_flexible}
            try:
                return llg.LLMatcher.grammar_from_json_schema(self.text, defaults=options)
            except ValueError as e:
                raise ConstraintError(f"the JSON schema was refused: {e}.") from None
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c) for c in json.loads(self.text))
            return llg.LLMatcher.grammar_from_lark(lark)
        try:
            return llg.grammar_from("grammar", self.text)
        except ValueError as e:
            raise ConstraintError(f"the grammar could not be read as Lark or GBNF: {e}.") from None

    def validate(self) -> "Constraint":
        """Compile the grammar once without a tokenizer; return ``self``.

        Raises:
            ConstraintError: naming what llguidance refused (an unsupported schema keyword,
                a regex syntax error, an undefined grammar rule, ...).
        """
        llg = _llguidance()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self.llguidance_grammar())
        if is_error:
            raise ConstraintError(f"the {self.kind.replace('_', ' ')} constraint was refused: {one_line(messages[0])}")
        return self

    def describe(self) -> str:
        """A short human-readable summary (for logs and errors)."""
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"{self.kind}({text})"
