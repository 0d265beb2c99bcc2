"""JSON schemas for structured-output tests: nested objects, arrays with item bounds, enums,
bounded numbers, string patterns and formats, optional fields, anyOf, $ref.

A tiny random-weight model writes whatever the grammar allows, so every string, array and
number here is bounded: the grammar then forces not only valid JSON but also an end within a
few dozen tokens (a schema with a free string is valid but may run to max_tokens).
"""
from __future__ import annotations

S = {"type": "string", "maxLength": 6}  # a short free string
NAME = {"type": "string", "minLength": 1, "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}
COLOR = {"enum": ["red", "green", "blue"]}


def obj(required: dict | None = None, optional: dict | None = None, **extra) -> dict:
    properties = {**(required or {}), **(optional or {})}
    return {"type": "object", "properties": properties, "required": list(required or {}),
            **extra}


def arr(items: dict, lo: int = 0, hi: int = 3, **extra) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi, **extra}


SCHEMAS: list[dict] = [
    # flat objects
    obj({"name": NAME, "age": SMALL_INT}),
    obj({"ok": {"type": "boolean"}}),
    obj({"nothing": {"type": "null"}}),
    obj({"a": S, "b": S, "c": S}),
    obj({"id": {"type": "integer", "minimum": -50, "maximum": 50}}),
    obj({"score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    obj({"year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}}),
    obj({"count": {"type": "integer", "minimum": 0, "maximum": 9, "multipleOf": 3}}),
    obj({"flag": {"const": "on"}}),
    # enums
    obj({"color": COLOR}),
    obj({"size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}),
    obj({"level": {"enum": [1, 2, 3]}}),
    obj({"mixed": {"enum": ["a", 1, True, None]}}),
    {"enum": ["alpha", "beta", "gamma"]},
    # optional and required fields
    obj({"name": NAME}, {"nick": NAME}),
    obj({}, {"a": SMALL_INT, "b": {"type": "boolean"}}),
    obj({"x": SMALL_INT}, {"y": SMALL_INT, "z": SMALL_INT}),
    obj({"tag": COLOR}, {"note": S}, additionalProperties=False),
    # string patterns and formats
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"word": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}}),
    obj({"day": {"type": "string", "format": "date"}}),
    obj({"at": {"type": "string", "format": "time"}}),
    obj({"when": {"type": "string", "format": "date-time"}}),
    obj({"id": {"type": "string", "format": "uuid"}}),
    obj({"ip": {"type": "string", "format": "ipv4"}}),
    obj({"short": {"type": "string", "minLength": 2, "maxLength": 3}}),
    # arrays
    arr(SMALL_INT, 1, 3),
    arr(COLOR, 2, 2),
    arr(S, 0, 2),
    obj({"tags": arr(NAME, 1, 3)}),
    obj({"matrix": arr(arr(SMALL_INT, 1, 2), 1, 2)}),
    obj({"points": arr(obj({"x": SMALL_INT, "y": SMALL_INT}), 1, 2)}),
    obj({"flags": arr({"type": "boolean"}, 3, 3)}),
    {"type": "array", "prefixItems": [SMALL_INT, COLOR], "items": False},
    obj({"uniq": arr({"enum": ["a", "b", "c"]}, 0, 3)}),
    # nested objects
    obj({"user": obj({"name": NAME, "address": obj({"city": NAME, "zip": {
        "type": "string", "pattern": "^[0-9]{4}$"}})})}),
    obj({"a": obj({"b": obj({"c": obj({"d": SMALL_INT})})})}),
    obj({"meta": obj({"version": SMALL_INT}, {"beta": {"type": "boolean"}})}),
    obj({"order": obj({"id": SMALL_INT, "items": arr(obj({"sku": NAME, "qty": SMALL_INT}),
                                                         1, 2)})}),
    # anyOf, oneOf, type unions
    obj({"value": {"anyOf": [SMALL_INT, COLOR]}}),
    obj({"value": {"anyOf": [{"type": "null"}, NAME]}}),
    {"anyOf": [obj({"kind": {"const": "cat"}, "lives": SMALL_INT}),
               obj({"kind": {"const": "dog"}, "good": {"type": "boolean"}})]},
    obj({"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    obj({"pick": {"oneOf": [{"const": "x"}, {"const": "y"}]}}),
    obj({"either": {"anyOf": [arr(SMALL_INT, 1, 2), obj({"n": SMALL_INT})]}}),
    # $ref and $defs
    {"$defs": {"pt": obj({"x": SMALL_INT, "y": SMALL_INT})},
     **obj({"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}})},
    {"definitions": {"color": COLOR}, **obj({"fg": {"$ref": "#/definitions/color"},
                                               "bg": {"$ref": "#/definitions/color"}})},
    {"$defs": {"node": obj({"v": SMALL_INT}, {"next": {"$ref": "#/$defs/leaf"}}),
               "leaf": obj({"v": SMALL_INT})},
     "$ref": "#/$defs/node"},
    {"$defs": {"name": NAME, "person": obj({"name": {"$ref": "#/$defs/name"},
                                            "kids": arr({"$ref": "#/$defs/name"}, 0, 2)})},
     **obj({"parent": {"$ref": "#/$defs/person"}})},
    # scalars at the top level
    SMALL_INT,
    {"type": "boolean"},
    {"type": "string", "pattern": "^(yes|no)$"},
    {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.5},
    # a realistic tool-call-shaped schema
    obj({"name": {"enum": ["get_weather", "get_time"]},
         "arguments": obj({"city": NAME}, {"unit": {"enum": ["C", "F"]}})}),
]
