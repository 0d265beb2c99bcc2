"""Structured outputs: what a request's output must match (vLLM's `StructuredOutputsParams`).

Exactly one constraint is set. Its text travels to the engine once, inside the request's
`SamplingParams`; the engine core compiles it into a grammar. Checked here, on construction
and on decode: which constraint is set, the types, and the size. Whether a schema, regex or
grammar is valid is the grammar engine's call (`engine_core.structured_output.grammar`), which
the front-end asks before anything is sent.
"""
from __future__ import annotations

from typing import Any

import msgspec

from protocol.wire_struct import WireStruct

# The text of one constraint (a schema as compact JSON, a regex, a grammar, the choices) is
# at most this many characters: bounded work to validate and compile it, and bounded bytes in
# the messages that carry it.
MAX_CONSTRAINT_CHARS = 64 << 10
# A schema given as a Python dict is walked before it is measured; more nodes than this
# cannot fit MAX_CONSTRAINT_CHARS (a dict sharing sub-dicts would otherwise encode
# exponentially).
_MAX_NODES = MAX_CONSTRAINT_CHARS // 2
CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(ValueError):
    """A constraint that cannot be enforced; `field` names it (`json`, `regex`, ...)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{field} {reason}")
        self.field, self.reason = field, reason


class StructuredOutputsParams(WireStruct):
    """The constraint on a request's output (set exactly one of the first five).

    `json`: a JSON schema (a dict, or its JSON text); `json_object`: any JSON object;
    `regex`: the whole output matches it (Rust `regex` syntax); `choice`: the output is one of
    these strings; `grammar`: a Lark grammar (llguidance's dialect; GBNF is accepted too).
    `disable_any_whitespace`: JSON without any whitespace between tokens (`{"a":1}`; by
    default one space follows each `,` and `:`, as `json.dumps` writes).
    `disable_additional_properties`: whether an object schema that lists properties and does
    not say `additionalProperties` admits no others. Unset (None), it does not, as vLLM's
    default grammar backend behaves (a small model cannot wander off into keys of its own);
    False follows JSON Schema's default (other properties allowed), as vLLM's guidance
    backend does with this flag off.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in CONSTRAINTS if _is_set(getattr(self, name))]
        if len(chosen) != 1:
            found = f"got {' and '.join(chosen)}" if chosen else "got none"
            raise ValueError(f"structured_outputs must set exactly one of "
                             f"{', '.join(CONSTRAINTS)}; {found}")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if not isinstance(value, bool) and (value is not None
                                                or name == "disable_any_whitespace"):
                raise StructuredOutputsError(name, f"must be a bool, got {_short(value)}")
        _check_type(chosen[0], getattr(self, chosen[0]))
        size = len(self.spec)
        if size > MAX_CONSTRAINT_CHARS:
            raise StructuredOutputsError(chosen[0], f"must be at most {MAX_CONSTRAINT_CHARS} "
                                                    f"characters, got {size}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of CONSTRAINTS."""
        return next(name for name in CONSTRAINTS if _is_set(getattr(self, name)))

    @property
    def spec(self) -> str:
        """The constraint's text: a schema as JSON (in its own key order), the regex, the
        grammar, or the choices as a JSON list."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else _encode_schema(self.json)
        if kind == "json_object":
            return '{"type": "object"}'
        if kind == "choice":
            return msgspec.json.encode(self.choice).decode()
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str, bool, bool | None]:
        """What the compiled grammar depends on: equal keys, equal grammars."""
        return (self.kind, self.spec, self.disable_any_whitespace,
                self.disable_additional_properties)


def _is_set(value: object) -> bool:
    return value is not None and value is not False


def _check_type(kind: str, value: Any) -> None:
    if kind == "json" and not isinstance(value, str | dict):
        raise StructuredOutputsError(kind, f"must be a JSON schema (a dict or its JSON text), "
                                           f"got {_short(value)}")
    if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
        raise StructuredOutputsError(kind, f"must be a non-empty string, got {_short(value)}")
    if kind == "choice" and not (isinstance(value, list) and value
                                 and all(isinstance(c, str) and c for c in value)):
        raise StructuredOutputsError(kind, f"must be a non-empty list of non-empty strings, "
                                           f"got {_short(value)}")


def _encode_schema(schema: dict[str, Any]) -> str:
    _count_nodes(schema)
    try:
        return msgspec.json.encode(schema).decode()
    except (TypeError, msgspec.EncodeError) as e:
        raise StructuredOutputsError("json", f"must be JSON (a dict of JSON values): {e}") \
            from None


def _count_nodes(value: Any) -> None:
    stack, seen = [value], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > _MAX_NODES:
            raise StructuredOutputsError("json", f"must be at most {MAX_CONSTRAINT_CHARS} "
                                                 "characters as JSON")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
