"""LoRA adapters through the server: vLLM's `--lora-modules`, its runtime routes
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (only with
`--allow-runtime-lora-updating`; behind the API key like every route), and the adapters'
cards in `/v1/models`.

Loading checks the adapter against the base model off the event loop (400 naming the reason,
404 when there is nothing at the path), then registers it; the workers read it in the
background while steps go on. A request names an adapter by its name in `model`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response

from launch.async_llm import AsyncLLM
from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import read_body
from launch.lora.registry import LoRAAdapterError, LoRAAdapterNotFoundError
from protocol.lora import LoRARequest


class LoRAModulePath(msgspec.Struct, forbid_unknown_fields=True):
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModulePath]:
    """`--lora-modules` as vLLM reads it: `name=path` items, or JSON objects
    (`{"name", "path", "base_model_name"}`) or lists of them; ValueError naming a bad one."""
    modules: list[LoRAModulePath] = []
    for item in values or ():
        if not item:
            continue
        if "=" in item and "," not in item and not item.lstrip().startswith(("{", "[")):
            name, path = item.split("=", 1)
            modules.append(LoRAModulePath(name, path))
            continue
        try:
            data = json.loads(item)
            entries = data if isinstance(data, list) else [data]
            modules += [msgspec.convert(entry, LoRAModulePath) for entry in entries]
        except (json.JSONDecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"--lora-modules: {item!r} is neither name=path nor JSON "
                             f"{{\"name\", \"path\", \"base_model_name\"}}: {e}") from None
    return modules


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    group.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                       help="adapters served from the start, each `name=path` or JSON "
                            "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a "
                            "request picks one by its name in `model`")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                            "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; behind the API key): "
                            "whoever may call them makes this server read any path it can")


class LoRALoadRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class LoRAUnloadRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None


class OpenAIServingLoRA:
    def __init__(self, engine: AsyncLLM, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = base_names
        self.lock = asyncio.Lock()  # one load or unload at a time: each sees the last

    def load_static(self, modules: list[LoRAModulePath]) -> None:
        """`--lora-modules`, at start-up (before the event loop): ValueError naming a bad
        one, so the server does not start with it."""
        for module in modules:
            if module.name in self.base_names:
                raise ValueError(f"--lora-modules: {module.name!r} is the served model's name")
            lora = self.engine.lora.new_request(module.name, module.path,
                                                self._parent(module.base_model_name))
            self.engine.lora.commit(self.engine.lora.check(lora))

    async def load(self, raw: Request) -> Response:
        body = await read_body(raw, LoRALoadRequest)
        if not body.lora_name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        self._check_name(body.lora_name)
        async with self.lock:
            old = self.engine.lora.get(body.lora_name)
            if old is not None and not body.load_inplace:
                raise APIError(400, f"The lora adapter '{body.lora_name}' has already been "
                               "loaded. If you want to load the adapter in place, set "
                               "'load_inplace' to True.", "lora_name")
            lora = self.engine.lora.new_request(body.lora_name, body.lora_path,
                                                old and old.base_model_name, body.load_inplace)
            try:
                await self.engine.add_lora(lora, replace=body.load_inplace)
            except LoRAAdapterNotFoundError as e:
                raise APIError(404, str(e), "lora_path") from None
            except LoRAAdapterError as e:
                raise APIError(400, str(e), "lora_path") from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, raw: Request) -> Response:
        body = await read_body(raw, LoRAUnloadRequest)
        if not body.lora_name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self.lock:
            if self.engine.lora.get(body.lora_name) is None:
                raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                               "lora_name")
            self.engine.remove_lora(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def model_cards(self, created: int) -> list[dict[str, Any]]:
        """`/v1/models` entries of the adapters: `parent` their base model's served name."""
        return [{"id": lora.lora_name, "object": "model", "created": created,
                 "owned_by": "deltaserve", "root": lora.lora_path,
                 "parent": lora.base_model_name or self.base_names[0],
                 "max_model_len": self.engine.max_model_len} for lora in self.engine.lora.adapters()]

    def _check_name(self, name: str) -> None:
        if name in self.base_names:
            raise APIError(400, f"The lora adapter '{name}' conflicts with a served base "
                           "model.", "lora_name")

    def _parent(self, base_model_name: str | None) -> str | None:
        return base_model_name if base_model_name in self.base_names else None


def add_lora_routes(app: FastAPI, lora: OpenAIServingLoRA) -> None:
    app.post("/v1/load_lora_adapter")(lora.load)
    app.post("/v1/unload_lora_adapter")(lora.unload)


__all__ = ["LoRAModulePath", "LoRARequest", "OpenAIServingLoRA", "add_lora_args",
           "add_lora_routes", "parse_lora_modules"]
