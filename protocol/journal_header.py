"""Opening a journal for a recorded run: the header that makes the recording replayable."""
from __future__ import annotations

import glob
import hashlib
import os
import platform
import time
from importlib import metadata

from protocol.codec import PROTOCOL_VERSION
from protocol.engine_config import EngineConfig
from protocol.journal import JournalHeader, JournalWriter

_PACKAGES = ("deltaserve", "torch", "msgspec", "pyzmq", "numpy", "transformers", "llguidance")


def weights_hash(model_dir: str) -> str:
    """sha256 over the directory's weight files (and their names), in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def software_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def open_journal(config: EngineConfig) -> JournalWriter:
    header = JournalHeader(protocol_version=PROTOCOL_VERSION, engine_config=config,
                           weights_hash=weights_hash(config.model),
                           world_size=config.tensor_parallel_size, seed=config.seed,
                           versions=software_versions(), created_unix=time.time())
    return JournalWriter(config.record_path, header)
