"""The structured-output schema suite: JSON Schemas, regexes and choice lists.

A tiny random model never chooses to close a free string (each step it picks among ~300
tokens, only a few of which end it), so free text here is bounded (``maxLength``, ``maxItems``,
numeric ranges) and every output ends within the test's token budget. The real-model subset
(``REAL_SUBSET``) also has unbounded strings: a trained model closes them itself.
"""

from __future__ import annotations

S8 = {"type": "string", "maxLength": 8}
INT = {"type": "integer", "minimum": -50, "maximum": 50}


def obj(props: dict, required: list | None = None, **extra) -> dict:
    """An object schema with ``additionalProperties: false`` (what strict mode requires)."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS: dict[str, dict] = {
    # -- scalars ------------------------------------------------------------------------
    "bool": {"type": "boolean"},
    "null": {"type": "null"},
    "int_range": {"type": "integer", "minimum": 0, "maximum": 9},
    "int_neg_range": {"type": "integer", "minimum": -999, "maximum": -100},
    "int_exclusive": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    "number_range": {"type": "number", "minimum": 0, "maximum": 1},
    "number_neg": {"type": "number", "minimum": -5.5, "maximum": 2.25},
    "string_bounded": {"type": "string", "minLength": 2, "maxLength": 6},
    "string_exact": {"type": "string", "minLength": 3, "maxLength": 3},
    "const_str": {"const": "fixed value"},
    "const_obj": {"const": {"a": 1, "b": [True, None]}},
    "enum_str": {"enum": ["red", "green", "blue"]},
    "enum_mixed": {"enum": ["x", 1, 2.5, True, None]},
    # -- string formats and patterns -------------------------------------------------------
    "pattern_phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
    "pattern_ident": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,7}$"},
    "pattern_hex": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"},
    "format_date": {"type": "string", "format": "date"},
    "format_time": {"type": "string", "format": "time"},
    "format_datetime": {"type": "string", "format": "date-time"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "format_ipv4": {"type": "string", "format": "ipv4"},
    "format_email_bounded": obj({"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"}}),
    # -- objects ---------------------------------------------------------------------------
    "obj_person": obj({"name": S8, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "obj_optional": obj({"id": INT, "nick": S8, "score": {"type": "number", "minimum": 0, "maximum": 10}},
                        required=["id"]),
    "obj_all_optional": obj({"a": {"type": "boolean"}, "b": INT}, required=[]),
    "obj_nested": obj({"user": obj({"name": S8, "tags": {"type": "array", "items": S8, "maxItems": 2}}),
                       "active": {"type": "boolean"}}),
    "obj_deep": obj({"a": obj({"b": obj({"c": obj({"d": INT})})})}),
    "obj_enum_fields": obj({"color": {"enum": ["red", "green"]}, "size": {"enum": ["S", "M", "L", "XL"]}}),
    "obj_const_field": obj({"version": {"const": 2}, "kind": {"const": "event"}, "n": INT}),
    "obj_nullable": obj({"value": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}}),
    "obj_many_fields": obj({f"f{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(8)}),
    "obj_date_event": obj({"title": S8, "on": {"type": "string", "format": "date"},
                           "at": {"type": "string", "format": "time"}}),
    "obj_min_props": obj({"a": INT, "b": INT}, minProperties=2, maxProperties=2),
    "obj_pattern_values": obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "qty": INT}),
    "obj_unicode_keys": obj({"naïve": {"type": "boolean"}, "日本": INT}),
    "obj_escaped_keys": obj({"quote\"key": {"type": "boolean"}, "back\\slash": {"type": "null"}}),
    # -- arrays ----------------------------------------------------------------------------
    "arr_ints": {"type": "array", "items": INT, "minItems": 1, "maxItems": 4},
    "arr_exact": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    "arr_empty_ok": {"type": "array", "items": INT, "maxItems": 2},
    "arr_strings": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 2, "maxItems": 3},
    "arr_objects": {"type": "array", "items": obj({"k": S8, "v": INT}), "minItems": 1, "maxItems": 3},
    "arr_nested": {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 2}, "maxItems": 3},
    "arr_tuple": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 4}, INT, {"type": "boolean"}],
                  "items": False},
    "arr_enum_items": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 5},
    # -- composition -----------------------------------------------------------------------
    "anyof_scalar": {"anyOf": [INT, {"type": "boolean"}, {"type": "null"}]},
    "anyof_objects": {"anyOf": [obj({"cat": S8}), obj({"dog": INT})]},
    "oneof_tagged": {"oneOf": [obj({"kind": {"const": "a"}, "x": INT}),
                               obj({"kind": {"const": "b"}, "y": {"type": "boolean"}})]},
    "allof_merge": {"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                              {"type": "object", "properties": {"b": S8}, "required": ["b"]}],
                    "properties": {"a": {}, "b": {}}, "additionalProperties": False},
    "type_union": {"type": ["integer", "boolean"], "minimum": 0, "maximum": 99},
    "defs_ref": {"$defs": {"pt": obj({"x": INT, "y": INT})},
                 **obj({"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}})},
    "recursive_tree": {"$defs": {"node": {"type": "object",
                                          "properties": {"v": INT, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                                             "maxItems": 1}},
                                          "required": ["v", "kids"], "additionalProperties": False}},
                       "$ref": "#/$defs/node"},
    # -- realistic payloads ----------------------------------------------------------------
    "tool_args_weather": obj({"city": S8, "unit": {"enum": ["celsius", "fahrenheit"]}}, required=["city"]),
    "order": obj({"order_id": {"type": "string", "pattern": "^ORD[0-9]{4}$"},
                  "items": {"type": "array", "items": obj({"sku": S8, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                            "minItems": 1, "maxItems": 2},
                  "paid": {"type": "boolean"}}),
    "classification": obj({"label": {"enum": ["positive", "negative", "neutral"]},
                           "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
    "geo": obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180}}),
    "event_log": obj({"level": {"enum": ["debug", "info", "warn", "error"]},
                      "ts": {"type": "string", "format": "date-time"},
                      "codes": {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 599},
                                "maxItems": 2}}),
    "matrix": obj({"rows": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 9},
                                                         "minItems": 2, "maxItems": 2},
                            "minItems": 2, "maxItems": 2}}),
}

#: Schemas llguidance refuses (so the request is refused with a clear error, never ignored).
UNSUPPORTED = {
    "unevaluated": {"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False},
    "min_props_optional": {"type": "object", "properties": {"a": INT, "b": INT}, "minProperties": 1},
}

#: Schemas whose output a trained model writes freely (unbounded strings): the real-model subset.
REAL_SUBSET: dict[str, dict] = {
    "person_free": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                    "required": ["name", "age"], "additionalProperties": False},
    # (a number in [0, 1] is not here: the 270M model, once at "1.0", writes zeros forever; the
    # grammar allows any number of fraction digits, so that output ends only at max_tokens)
    "classification_pct": {"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "confidence_pct": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["label", "confidence_pct"], "additionalProperties": False},
    "enum_str": SCHEMAS["enum_str"],
    "arr_ints": SCHEMAS["arr_ints"],
    "format_date": SCHEMAS["format_date"],
    "oneof_tagged": SCHEMAS["oneof_tagged"],
}

#: Regexes (whole-output) and choice lists, with their bounded outputs.
REGEXES = [
    r"[0-9]{3}-[a-z]{2,5}",
    r"(yes|no)",
    r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",  # (Rust's \d is Unicode digits, which Python's re may not know)
    r"(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
    r"[a-f0-9]{8}",
    r"(GET|POST|PUT) /[a-z]{1,8}",
]

CHOICES = [
    ["yes", "no"],
    ["positive", "negative", "neutral"],
    ["Paris", "Par", "London", "New York"],
    ["a", "ab", "abc"],
    ["😀 smile", "plain"],
]
