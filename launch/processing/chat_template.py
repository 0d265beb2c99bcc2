"""A model directory's chat template, rendered as Hugging Face's `apply_chat_template`
renders it (same Jinja settings, globals and special tokens), in a sandbox and without
importing transformers."""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

from launch.processing.tokenizer import read_json


class ChatTemplateError(ValueError):
    """The directory has no chat template, or the template failed on these messages."""


class ChatTemplate:
    """One compiled template and the special tokens it may name (`bos_token`, ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _environment().from_string(source)

    @classmethod
    def from_model_dir(cls, model_dir: str, path: str | None = None) -> ChatTemplate:
        """The template in file `path` if given, else the directory's own; the special tokens
        it may name come from the directory's tokenizer config either way."""
        config = read_json(os.path.join(model_dir, "tokenizer_config.json"))
        if path is not None:
            with open(path) as f:
                source = f.read()
        else:
            source = _template_source(model_dir, config)
        if source is None:
            raise ChatTemplateError(f"the model directory {model_dir!r} has no chat template")
        return cls(source, _special_tokens(config))

    @classmethod
    def load(cls, model_dir: str, path: str | None = None) -> ChatTemplate | None:
        """`from_model_dir`, or None when there is no template at all (no file given and
        none in the directory)."""
        try:
            return cls.from_model_dir(model_dir, path)
        except ChatTemplateError:
            if path is not None:
                raise
            return None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **context: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]); extra
        template variables (`tools`, `documents`, ...) go in `context`."""
        import jinja2
        values = {**self.special_tokens, "tools": None, "documents": None, **context}
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt, **values)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError,
                ArithmeticError, RecursionError) as e:  # the template's own code failed
            raise ChatTemplateError(f"the chat template failed on these messages: "
                                    f"{type(e).__name__}: {e}") from e


def _environment() -> Any:
    """The environment HF compiles chat templates in: sandboxed (templates are untrusted
    code), trim_blocks and lstrip_blocks, loop controls, a non-escaping `tojson`."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _template_source(model_dir: str, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` (newer directories), else tokenizer_config.json's
    `chat_template`: a string, or a list of named templates of which "default" is used."""
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path) as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """Every `*_token` of the tokenizer config (`bos_token`, `eos_token`, ...), as text."""
    tokens = {}
    for name, value in config.items():
        value = value.get("content") if isinstance(value, dict) else value
        if name.endswith("_token") and isinstance(value, str):
            tokens[name] = value
    return tokens

