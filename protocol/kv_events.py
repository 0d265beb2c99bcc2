"""KV-cache events for cache-aware routers, on vLLM 0.32's wire format.

A publisher sends multipart `(topic, sequence number as 8 big-endian bytes, msgpack
KVEventBatch)`. A batch is a msgpack array `[ts, events, data_parallel_rank]`; each event is a
map tagged `"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"`, fields in vLLM's
order, defaults omitted (vLLM's `vllm.distributed.kv_events`), so a consumer written for vLLM
decodes ours. Block hashes travel as vLLM's default external hash: an unsigned 64-bit integer,
the low 64 bits of the hash read big-endian (`external_block_hash`).
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec

from protocol.json_option import parse_json_option

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # vLLM's port, on loopback
MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache (its primary tier), on any device


def external_block_hash(digest: bytes) -> int:
    """A block hash as vLLM sends it (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default):
    the low 64 bits of the digest read as a big-endian unsigned integer."""
    return int.from_bytes(digest[-8:], "big")


class KVEventsConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """vLLM's `--kv-events-config` keys and defaults, except the endpoint, which binds on
    loopback unless told otherwise."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (messages)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        for name in ("buffer_steps", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be at least 1")
        if self.hwm < 0:
            raise ValueError("kv_events_config.hwm must be non-negative")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events_config.{name} must be tcp://, ipc:// or "
                                 f"inproc://, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(value: Any) -> KVEventsConfig | None:
    """A config from JSON text, a dict, or a config; ValueError with one line if malformed."""
    if value is None:
        return None
    return parse_json_option(value, KVEventsConfig, "kv_events_config")


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The base of the events; the tag is the class name, under "type"."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one sequence entered the prefix cache: `token_ids` are
    their tokens (block_size per block), `parent_block_hash` the block before the first."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block, if hashed with any


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
