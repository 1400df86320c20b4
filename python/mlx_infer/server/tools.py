"""Tool calling: tools into the chat template, tool calls out of the generated text.

The tools go to the model's own chat template (its ``tools`` variable, as transformers passes
them); assistant ``tool_calls`` and ``tool`` messages of the history go to it as transformers
shapes them (arguments as objects). The reply is parsed per template family, detected from the
template text (:data:`FORMATS`, one small parser each):

* ``hermes`` (Qwen, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
* ``llama3_json``: ``<|python_tag|>``-optional ``{"name": ..., "parameters": {...}}`` (; separated)
* ``gemma4``: ``<|tool_call>call:NAME{...}<tool_call|>``
* ``json`` (Gemma 3 and templates without tool markup): a reply that is a JSON object
  ``{"name", "arguments"|"parameters"}`` or a list of them, bare or in a ``tool_call`` fence.

``tool_choice`` ``"required"`` or a named function constrains the output (vLLM's way): a named
function's output is its arguments, constrained by its parameter schema; ``required`` is a JSON
array of ``{"name", "parameters"}`` objects constrained per function. Either is valid by
construction and parsed as that JSON, whatever the family.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ..constraints import Constraint


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def _call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or (names and name not in names):
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any]:
    """Every top-level JSON value in ``text`` (separated by whitespace, ``;`` or ``,``)."""
    dec, i, out = json.JSONDecoder(), 0, []
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            break
        try:
            value, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return []
        out.append(value)
    return out


def _calls_from_json(text: str, names: set[str]) -> list[ToolCall] | None:
    values = _json_values(text)
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_call(v, names) for v in flat]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _parse_tagged(start: str, end: str) -> Callable[[str, set[str]], tuple[str, list[ToolCall]]]:
    pattern = re.compile(re.escape(start) + r"(.*?)(?:" + re.escape(end) + r"|$)", re.S)

    def parse(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        for m in pattern.finditer(text):
            found = _calls_from_json(m.group(1).strip(), names)
            if found is None:
                return text, []  # malformed markup: leave it as content
            calls += found
        if not calls:
            return text, []
        return pattern.sub("", text).strip(), calls

    return parse


def _parse_mistral(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    head, sep, tail = text.partition("[TOOL_CALLS]")
    if not sep:
        return text, []
    calls = _calls_from_json(tail.strip(), names)
    return (head.strip(), calls) if calls else (text, [])


def _parse_llama3(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = _calls_from_json(body, names)
    return ("", calls) if calls else (text, [])


_GEMMA4 = re.compile(r"<\|tool_call>call:([A-Za-z0-9_.\-]+)(\{.*?\})<tool_call\|>", re.S)


def _parse_gemma4(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    calls = []
    for m in _GEMMA4.finditer(text):
        try:
            args = json.loads(m.group(2))
        except json.JSONDecodeError:
            return text, []
        if names and m.group(1) not in names:
            return text, []
        calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)))
    return (_GEMMA4.sub("", text).strip(), calls) if calls else (text, [])


_FENCE = re.compile(r"^```(?:tool_call|tool_code|json)?\s*(.*?)\s*```$", re.S)


def _parse_json(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    m = _FENCE.match(body)
    if m:
        body = m.group(1)
    if not body.startswith(("{", "[")):
        return text, []
    calls = _calls_from_json(body, names)
    return ("", calls) if calls else (text, [])


@dataclass(frozen=True)
class ToolFormat:
    """How one template family writes tool calls."""

    name: str
    markers: tuple[str, ...]  # text in a chat template that identifies the family
    start: str  # what opens a call in generated text ("" = the reply itself is the call)
    parse: Callable[[str, set[str]], tuple[str, list[ToolCall]]]


FORMATS: tuple[ToolFormat, ...] = (
    ToolFormat("hermes", ("<tool_call>",), "<tool_call>", _parse_tagged("<tool_call>", "</tool_call>")),
    ToolFormat("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS]", _parse_mistral),
    ToolFormat("gemma4", ("<|tool_call>",), "<|tool_call>", _parse_gemma4),
    ToolFormat("llama3_json", ("<|python_tag|>", "ipython"), "{", _parse_llama3),
    ToolFormat("json", (), "", _parse_json),
)


def detect_format(chat_template: str | None) -> ToolFormat:
    """The tool-call format of a chat template (``json`` when it names no markup)."""
    text = chat_template or ""
    for fmt in FORMATS:
        if any(m in text for m in fmt.markers):
            return fmt
    return FORMATS[-1]


# -- requests ----------------------------------------------------------------------------


def functions_of(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{name: function}`` of OpenAI ``tools`` (``[{"type": "function", "function": {...}}]``).

    Raises:
        ValueError: a tool that is not a function with a name (the message names its index).
    """
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}.")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}.")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object.")
        if name in out:
            raise ValueError(f"tools[{i}]: the function name {name!r} is given twice.")
        out[name] = {**fn, "parameters": params}
    return out


def _params(fn: dict[str, Any]) -> dict[str, Any]:
    p = dict(fn["parameters"])
    p.setdefault("type", "object")
    return p


def required_constraint(functions: dict[str, dict[str, Any]], *, parallel: bool) -> Constraint:
    """``tool_choice="required"``: a JSON array of calls, each ``{"name", "parameters"}`` of one function."""
    items = [{"type": "object", "properties": {"name": {"const": n}, "parameters": _params(f)},
              "required": ["name", "parameters"], "additionalProperties": False} for n, f in functions.items()]
    schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return Constraint.json_schema(schema)


def named_constraint(fn: dict[str, Any]) -> Constraint:
    """A named ``tool_choice``: the output is the function's arguments, valid under its parameters."""
    return Constraint.json_schema(_params(fn))


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a ``required`` reply (a JSON array the constraint produced)."""
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History messages as transformers' templates take them: tool-call arguments as objects."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            shaped = []
            for c in calls:
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args)
                    except json.JSONDecodeError:
                        pass
                shaped.append({**c, "function": fn, **fn})  # some templates read call.name directly
            m = {**m, "tool_calls": shaped}
        out.append(m)
    return out


# -- one request's plan ------------------------------------------------------------------


class ToolPlan:
    """What ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` make of one chat request.

    Attributes:
        mode: ``"none"`` (no tools offered), ``"auto"``, ``"required"`` or ``"named"``.
        template_tools: the ``tools`` the chat template sees (``None``: none).
        constraint: the constraint ``required`` / named imposes (``None`` otherwise).
    """

    def __init__(self, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
                 chat_template: str | None):
        self.functions = functions_of(tools) if tools else {}
        self.format = detect_format(chat_template)
        self.parallel = parallel is not False
        choice = tool_choice if tool_choice is not None else ("auto" if self.functions else "none")
        self.named: str | None = None
        if isinstance(choice, dict):
            fn = choice.get("function") if choice.get("type", "function") == "function" else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str):
                raise ValueError('tool_choice must be "none", "auto", "required" or '
                                 '{"type": "function", "function": {"name": ...}}.')
            if name not in self.functions:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools "
                                 f"({', '.join(self.functions) or 'none given'}).")
            self.mode, self.named = "named", name
        elif choice in ("none", "auto", "required"):
            if choice != "none" and not self.functions:
                raise ValueError(f'tool_choice "{choice}" needs tools.')
            self.mode = choice
        else:
            raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}.')
        self.template_tools = list(tools) if tools and self.mode != "none" else None
        self.constraint: Constraint | None = None
        if self.mode == "required":
            self.constraint = required_constraint(self.functions, parallel=self.parallel)
        elif self.mode == "named":
            self.constraint = named_constraint(self.functions[self.named])
        self._buf = ""
        self._held = False  # a call began: the rest is buffered until the end
        self._content = False  # the reply is plain text (json family): stream it as is
        self._started = False

    # -- a whole reply ---------------------------------------------------------------

    def parse(self, text: str, finish: str | None) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a finished reply (calls only from a complete reply)."""
        if self.mode == "none" or finish != "stop":
            return text, []
        try:
            if self.mode == "named":
                json.loads(text)
                return None, [ToolCall(self.named, text)]
            if self.mode == "required":
                return None, parse_required(text)
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
        content, calls = self.format.parse(text, set(self.functions))
        if not self.parallel:
            calls = calls[:1]
        return (content or None) if calls else text, calls

    # -- streaming -------------------------------------------------------------------

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """Deltas for a streamed text piece: content, or tool-call argument pieces; markup is held back."""
        if self.mode == "none":
            return [{"content": piece}] if piece else []
        if self.mode == "named":
            out = []
            if not self._started:
                self._started = True
                out.append({"tool_calls": [ToolCall(self.named, "").openai(0)]})
            if piece:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return out
        if self._content:
            return [{"content": piece}] if piece else []
        self._buf += piece
        if self.mode == "required" or self._held:
            return []
        start = self.format.start
        if not start:  # the reply itself is the call: decide on its first character
            body = self._buf.lstrip()
            if not body:
                return []
            if body[0] in "{[`":
                self._held = True
                return []
            text, self._buf = self._buf, ""
            self._content = True
            return [{"content": text}]
        i = self._buf.find(start)
        if i >= 0:
            text, self._buf, self._held = self._buf[:i], self._buf[i:], True
            return [{"content": text}] if text else []
        keep = next((k for k in range(min(len(start) - 1, len(self._buf)), 0, -1)
                     if self._buf.endswith(start[:k])), 0)
        text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return [{"content": text}] if text else []

    def end(self, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas and the finish reason (``tool_calls`` when calls were made)."""
        if self.mode == "none":
            return [], finish
        if self.mode == "named":
            return self.feed("") if not self._started else [], "tool_calls" if finish == "stop" else finish
        content, calls = self.parse(self._buf, finish) if self._held or self.mode == "required" else (self._buf, [])
        if calls:
            deltas = [{"content": content}] if content else []
            deltas += [{"tool_calls": [c.openai(i)]} for i, c in enumerate(calls)]
            return deltas, "tool_calls"
        return ([{"content": self._buf}] if self._buf else []), finish
