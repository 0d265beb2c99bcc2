"""A constraint as an llguidance grammar, and the cheap check that it is one.

JSON whitespace rule (llguidance's JSON compile options, given as defaults, so a schema's own
`"x-guidance"` options win): outside strings, exactly one space follows each `,` and `:` and
there is no other whitespace, which is how `json.dumps` writes JSON; with
`disable_any_whitespace`, none at all (`json.dumps(..., separators=(",", ":"))`). A model
therefore cannot pad its JSON with whitespace until `max_tokens` runs out. A schema that
wants any whitespace says `"x-guidance": {"whitespace_flexible": true, "item_separator": ",",
"key_separator": ":"}`.

Grammars (`grammar`) are llguidance's Lark dialect: `start: ...` rules, "literals",
/regexes/, `%ignore`, `%json {...}` for an embedded schema, and `<|special|>` tokens; GBNF
(`root ::= ...`, llama.cpp's) is converted to it. Regexes are the Rust `regex` crate's syntax
and must match the whole output.
"""
from __future__ import annotations

import copy
import functools
import json
from typing import Any

from protocol.structured_outputs import StructuredOutputsError, StructuredOutputsParams

MAX_REASON_CHARS = 400  # of llguidance's message in a refusal
_SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) that enforces `params`; StructuredOutputsError
    if the constraint is not even well-formed (e.g. a schema that is not a JSON object)."""
    import llguidance
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = _schema(params) if kind == "json" else params.spec
            options = _COMPACT if params.disable_any_whitespace else _SPACED
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        return llguidance.grammar_from(kind, params.spec)  # "regex", "choice", "grammar"
    except StructuredOutputsError:
        raise
    except (ValueError, TypeError) as e:
        raise StructuredOutputsError(kind, invalid_reason(kind, str(e))) from None


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise StructuredOutputsError (a ValueError naming the field) if llguidance cannot
    build a grammar from `params`. Cached by the constraint's key."""
    error = _check(params.key)
    if error:
        raise StructuredOutputsError(params.kind, error)


@functools.lru_cache(maxsize=256)  # keys hold up to 64 KiB of text each
def _check(key: tuple[str, str, bool, bool | None]) -> str:
    import llguidance
    kind, spec, no_whitespace, no_additional = key
    params = StructuredOutputsParams(**{kind: True if kind == "json_object" else
                                        json.loads(spec) if kind == "choice" else spec},
                                     disable_any_whitespace=no_whitespace,
                                     disable_additional_properties=no_additional)
    try:
        grammar = grammar_text(params)
    except StructuredOutputsError as e:
        return e.reason
    message = llguidance.LLMatcher.validate_grammar(grammar)
    return invalid_reason(kind, message) if message else ""


def _schema(params: StructuredOutputsParams) -> str | dict[str, Any]:
    schema: Any = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise StructuredOutputsError("json", f"is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise StructuredOutputsError("json", "must be a JSON schema object")
    if params.disable_additional_properties is not False:
        schema = copy.deepcopy(schema)
        _close_objects(schema)
    return schema


def _close_objects(node: Any) -> None:
    """vLLM's rule: every object schema that lists (pattern) properties and does not say
    `additionalProperties` gets `additionalProperties: false`."""
    if isinstance(node, dict):
        for value in node.values():
            _close_objects(value)
        if "additionalProperties" not in node and ("properties" in node
                                                   or "patternProperties" in node):
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for item in node:
            _close_objects(item)


def invalid_reason(kind: str, message: str) -> str:
    """Why llguidance refused a constraint, as the end of a sentence naming its field."""
    what = {"json": "a valid JSON schema", "json_object": "a valid JSON schema",
            "regex": "a valid regex", "choice": "a valid choice list",
            "grammar": "a valid grammar"}[kind]
    message = message.replace("<non-verbose/>", "").strip()
    if len(message) > MAX_REASON_CHARS:  # e.g. a list of every special token
        message = message[:MAX_REASON_CHARS] + "..."
    return f"is not {what}: {message}"


def answer_lark(params: StructuredOutputsParams) -> str:
    """`params` as the body of one Lark rule (llguidance's dialect), to embed it after text
    the constraint does not cover (e.g. a model's reasoning). The same whitespace and
    additional-properties rules as `grammar_text`."""
    import llguidance
    import llguidance.gbnf_to_lark as gbnf
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = _schema(params) if kind == "json" else json.loads(params.spec)
        options = _COMPACT if params.disable_any_whitespace else _SPACED
        schema = {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}
        return "%json " + json.dumps(schema, ensure_ascii=False)
    if kind == "regex":
        return "/" + llguidance.regex_to_lark(params.regex) + "/"
    if kind == "choice":
        return " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice)
    return "%lark {\n" + gbnf.any_to_lark(params.grammar) + "\n}"
