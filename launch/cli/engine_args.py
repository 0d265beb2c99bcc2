"""Command-line flags for every engine option, generated from `EngineConfig`'s fields.

A flag is `--field-name` (or the field's `flag`), with the field's description as help, its
`Literal` values as choices, and `--no-...` for booleans, so a new option appears on every
command that starts an engine without being listed anywhere else.
"""
from __future__ import annotations

import argparse
import os
import types
import typing
from typing import Any

import msgspec

from launch.model_cache.cache import DEFAULT_MODEL, SHIPPED_MODEL
from protocol.engine_config import EngineConfig, literal_choices


def add_engine_args(parser: argparse.ArgumentParser, model_default: str = DEFAULT_MODEL) -> None:
    group = parser.add_argument_group("engine")
    for field in msgspec.structs.fields(EngineConfig):
        base, meta = _unwrap(field.type)
        extra = meta.extra or {} if meta is not None else {}
        flags = [extra.get("flag", "--" + field.name.replace("_", "-")), *extra.get("aliases", ())]
        kwargs: dict[str, Any] = {"dest": field.name, "help": meta.description if meta else None}
        if field.name == "model":
            kwargs.update(default=model_default,
                          help=f"{kwargs['help']}, or a known name (default: {model_default}; "
                               f"offline: {os.path.relpath(SHIPPED_MODEL)})")
        else:
            kwargs.update(_value_kwargs(base, field.default))
        group.add_argument(*flags, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options in a parsed namespace (all but the model), as keyword arguments of
    `EngineConfig`."""
    return {name: getattr(args, name) for name in EngineConfig.__struct_fields__
            if name != "model" and hasattr(args, name)}


def _value_kwargs(annotation: Any, default: Any) -> dict[str, Any]:
    choices = literal_choices(annotation)
    if choices:
        return {"choices": list(choices), "default": default}
    kind = _non_optional(annotation)
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return {"type": _json_of(kind), "default": default, "metavar": "JSON"}
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction, "default": default}
    if typing.get_origin(kind) is list:
        return {"type": typing.get_args(kind)[0], "nargs": "*", "default": default}
    return {"type": kind, "default": default}


def _json_of(kind: type[msgspec.Struct]) -> Any:
    """An argparse type: JSON text decoded as `kind`, or one line saying what is wrong."""
    def parse(text: str) -> msgspec.Struct:
        try:
            return msgspec.json.decode(text, type=kind)
        except (msgspec.DecodeError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"invalid JSON for {kind.__name__}: {e}") from None
    parse.__name__ = kind.__name__
    return parse


def _unwrap(annotation: Any) -> tuple[Any, msgspec.Meta | None]:
    if typing.get_origin(annotation) is typing.Annotated:
        base, *metas = typing.get_args(annotation)
        return base, next((m for m in metas if isinstance(m, msgspec.Meta)), None)
    return annotation, None


def _non_optional(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation
