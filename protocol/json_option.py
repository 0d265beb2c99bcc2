"""An engine option given as JSON (a flag's text), a dict or the option struct itself."""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


def parse_json_option(value: Any, kind: type[T], name: str) -> T:
    """`value` as a `kind`; ValueError with one line naming the option `name` if malformed
    (a struct's own __post_init__ errors already name it and pass through as they are)."""
    if isinstance(value, kind):
        return value
    try:
        if isinstance(value, (str, bytes)):
            return msgspec.json.decode(value, type=kind)
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as e:
        message = str(e)
        raise ValueError(message if message.startswith(name) else f"{name}: {message}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None
