"""Hugging Face `org/name` model ids, resolved through the hub cache the way `huggingface_hub`
lays it out ($HF_HOME/hub, or $HF_HUB_CACHE: `models--org--name/snapshots/<revision>/...`,
`refs/main` naming the revision): offline first, downloading with `huggingface_hub` only when
the cache has no snapshot (and HF_HUB_OFFLINE is not set).

A snapshot with a config.json is a model directory as it is; one with GGUF files and no
config runs its GGUF file (the only one, or the one named after `:`, as in
`org/name-GGUF:Q4_K_M`)."""
from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")
# What a model directory needs; GGUF repositories hold many large files, fetched on demand.
_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]


def is_repo_id(name: str) -> bool:
    """`org/name` (optionally `:TAG` choosing a GGUF file), not an existing path."""
    return bool(_REPO_ID.fullmatch(name)) and not os.path.exists(name)


def hub_model_dir(name: str, gguf_dir: Callable[[str], str]) -> str:
    """The cached snapshot of `name`, downloaded if absent; a GGUF-only snapshot through
    `gguf_dir` (its GGUF file -> a model directory)."""
    repo_id, _, tag = name.partition(":")
    snapshot = _snapshot(repo_id, tag)
    if os.path.isfile(os.path.join(snapshot, "config.json")):
        return snapshot
    files = sorted(glob.glob(os.path.join(snapshot, "*.gguf")))
    if tag:
        files = [f for f in files if tag.lower() in os.path.basename(f).lower()]
    if len(files) != 1:
        found = ", ".join(os.path.basename(f) for f in files) or "none"
        raise ValueError(f"{name}: the snapshot has no config.json and not exactly one GGUF "
                         f"file{' matching ' + tag if tag else ''} (found: {found}); name one "
                         "as org/name:TAG")
    return gguf_dir(files[0])


def _snapshot(repo_id: str, tag: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    patterns = [*_PATTERNS, f"*{tag}*.gguf" if tag else "*.gguf"]
    cache = cache_dir()
    try:
        return snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ValueError(f"model {repo_id!r} is not in the Hugging Face cache ({cache}) and "
                         "HF_HUB_OFFLINE is set")
    try:
        return snapshot_download(repo_id, cache_dir=cache, allow_patterns=patterns)
    except Exception as e:  # unreachable, unknown repository, gated
        raise ValueError(f"model {repo_id!r} is not in the Hugging Face cache ({cache}) and "
                         f"could not be downloaded: {type(e).__name__}: {e}") from None


def cache_dir() -> str:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (read at each call)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")
