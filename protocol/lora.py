"""LoRA adapters on the wire: which adapter a request runs with, and the messages that
register adapters with the engine core and have workers load them ahead of their requests.

A request's adapter travels in full (`LoRARequest`: name, id, path, and the digest of its files
the front-end registered) with the request (`AddRequest`, then `NewRequestData`), so every step
message names what its workers need: a worker that never saw `LoadLoRA` (a replay) reads the
adapter by its path when a step first needs it.
"""
from __future__ import annotations

from protocol.wire_struct import WireStruct

MAX_LORA_NAME = 256  # characters of an adapter name
MAX_LORA_PATH = 4096


class LoRARequest(WireStruct):
    """One LoRA adapter, as vLLM names it: `LoRARequest(name, id, path)`.

    `lora_int_id` (>= 1) is the adapter's identity inside an engine: two requests with the
    same id run the same weights. `digest` is filled in by the front-end when it registers the
    adapter (a hash of its files, so a journal says which weights ran and the prefix cache
    never mixes two versions of one path); `base_model_name` is what `/v1/models` reports as
    its parent (the served model when None). Equal (and hashed) by name, as in vLLM.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    digest: str = ""

    def __post_init__(self) -> None:
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"a LoRA adapter's id must be an integer >= 1, got "
                             f"{self.lora_int_id!r}")
        if not self.lora_name or len(self.lora_name) > MAX_LORA_NAME:
            raise ValueError(f"a LoRA adapter needs a name of 1 to {MAX_LORA_NAME} characters")
        if not self.lora_path or len(self.lora_path) > MAX_LORA_PATH or "\0" in self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a path (a PEFT adapter "
                             "directory)")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    def same_adapter(self, other: LoRARequest) -> bool:
        """Whether both name the same weights: id, name, path and digest all equal."""
        return (self.lora_int_id, self.lora_name, self.lora_path, self.digest) == \
            (other.lora_int_id, other.lora_name, other.lora_path, other.digest)


def lora_hash_keys(lora: LoRARequest | None) -> tuple[str, ...]:
    """What a request's adapter adds to each of its KV blocks' hashes (none for the base
    model): blocks of two adapters, or of two versions of one path, never match."""
    if lora is None:
        return ()
    return ("lora", lora.lora_name, lora.lora_path, lora.digest)


# --- front-end -> engine core ---------------------------------------------------------------

class AddLoRA(WireStruct, tag=15):
    """An adapter the front-end validated and registered: the engine core has its workers load
    it now (in the background), before requests for it arrive."""

    lora_request: LoRARequest


class RemoveLoRA(WireStruct, tag=16):
    """An adapter unregistered: workers may drop it once no request of theirs uses it."""

    lora_int_id: int


# --- engine core -> workers -----------------------------------------------------------------

class LoadLoRA(WireStruct, tag=33):
    """Start loading an adapter off the step path (workers do not answer)."""

    lora_request: LoRARequest


class UnloadLoRA(WireStruct, tag=34):
    lora_int_id: int
