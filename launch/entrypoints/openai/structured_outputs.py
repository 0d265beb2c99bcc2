"""The request fields that ask for structured output, as one `StructuredOutputsParams`.

Accepted (at most one of them may ask for a constraint):
  `response_format`   OpenAI's: {"type": "text"} (none), {"type": "json_object"}, or
                      {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                      (`strict` changes nothing: objects are closed unless the schema says
                      `additionalProperties`, see StructuredOutputsParams)
  `structured_outputs` vLLM's body extra: StructuredOutputsParams' fields
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: vLLM's older extras.
Anything wrong is a 400 naming the field, before the request is tokenized.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from launch.entrypoints.openai.errors import APIError
from protocol import StructuredOutputsError, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_PARAM_FIELDS = frozenset(StructuredOutputsParams.__struct_fields__)


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's constraint and where in the body it came from: `param` is the top-level
    field, `name` how error messages call it (None: `param` + "." + the constraint's kind)."""

    params: StructuredOutputsParams
    param: str
    name: str | None = None

    def describe(self, error: StructuredOutputsError) -> APIError:
        """A grammar engine's refusal as a 400 naming the field as the client wrote it."""
        return refusal(self.param, self.name, error)


def refusal(param: str, name: str | None, error: StructuredOutputsError) -> APIError:
    return APIError(400, f"{name or f'{param}.{error.field}'} {error.reason}", param)


class StructuredFields(msgspec.Struct, kw_only=True):
    """The body fields this module reads (a base of the completion and chat bodies)."""

    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


def constraint_of(body: StructuredFields) -> Constraint | None:
    """The one constraint the body asks for (None: free text); APIError 400 otherwise."""
    found = [c for c in (_from_response_format(body.response_format),
                         _from_structured_outputs(body.structured_outputs),
                         *(_from_guided(name, getattr(body, name)) for name in _GUIDED))
             if c is not None]
    if len(found) > 1:
        raise APIError(400, f"only one structured-output constraint per request; got "
                       f"{' and '.join(c.param for c in found)}", found[1].param)
    return found[0] if found else None


def _from_response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _make({"json_object": True}, "response_format", "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict | str):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema "
                           "object", "response_format")
        return _make({"json": schema}, "response_format", "response_format.json_schema.schema")
    raise APIError(400, "response_format.type must be one of text, json_object, json_schema",
                   "response_format")


def _from_structured_outputs(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(value) - _PARAM_FIELDS)
    if unknown:
        raise APIError(400, f"structured_outputs has unknown fields {', '.join(unknown)}; "
                       f"known: {', '.join(sorted(_PARAM_FIELDS))}", "structured_outputs")
    return _make(value, "structured_outputs")


def _from_guided(name: str, value: Any) -> Constraint | None:
    return None if value is None else _make({_GUIDED[name]: value}, name, name)


def _make(fields: dict[str, Any], param: str, name: str | None = None) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(**fields), param, name)
    except StructuredOutputsError as e:
        raise refusal(param, name, e) from None
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e).replace("structured_outputs", param, 1), param) from None

