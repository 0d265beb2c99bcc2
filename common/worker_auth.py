"""Proof that a worker was started by (or for) this engine.

Every engine has a secret: a fresh random one handed to the workers it spawns through the
environment (never argv, which any user can read), or, for workers on other hosts, one read
from a file both sides have. A worker's hello carries an HMAC of its rank, pid and socket
identity under the secret; the engine core ignores hellos without a valid one. Over tcp the
link is also encrypted and mutually authenticated with ZeroMQ CURVE, with both key pairs
derived from the secret, so a listener on the network learns nothing and can replay nothing.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

import zmq
from zmq.utils import z85

SECRET_ENV = "DELTASERVE_WORKER_SECRET"
MAX_SECRET_FILE = 1 << 16  # a secret file is a key, not a document


def new_secret() -> str:
    return secrets.token_hex(32)


def read_secret_file(path: str) -> str:
    """The secret in a file: UTF-8 text (surrounding whitespace ignored) of at least 16
    characters, or raw bytes (e.g. `head -c 32 /dev/urandom`) of at least 16 bytes, which
    stand as `hex:` and their hex digits. Every process reading the same file derives the
    same secret. Any problem is a ValueError of one line naming the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_FILE + 1)
    except OSError as e:
        raise ValueError(f"cannot read the worker secret file {path!r}: {e.strerror}") from None
    if len(data) > MAX_SECRET_FILE:
        raise ValueError(f"the worker secret file {path!r} is over {MAX_SECRET_FILE} bytes")
    try:
        secret = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        if len(data) < 16:
            raise ValueError(f"the worker secret in {path!r} is too short (at least 16 "
                             "bytes)") from None
        return "hex:" + data.hex()
    if len(secret) < 16:
        raise ValueError(f"the worker secret in {path!r} is too short (at least 16 characters)")
    return secret


def secret_from_environment() -> str | None:
    return os.environ.get(SECRET_ENV) or None


def hello_proof(secret: str, rank: int, pid: int, identity: bytes) -> bytes:
    message = f"deltaserve-hello:{rank}:{pid}:".encode() + identity
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def proof_is_valid(secret: str, proof: bytes, rank: int, pid: int, identity: bytes) -> bool:
    return hmac.compare_digest(hello_proof(secret, rank, pid, identity), proof)


def _curve_pair(secret: str, role: str) -> tuple[bytes, bytes]:
    private = z85.encode(hashlib.sha256(f"{role}:{secret}".encode()).digest())
    return zmq.curve_public(private), private


def secure_server(socket: zmq.Socket, secret: str) -> zmq.auth.thread.ThreadAuthenticator:
    """Make `socket` (not yet bound) a CURVE server that admits only clients holding the
    secret. Returns the authenticator thread, which the caller stops when closing."""
    from zmq.auth.thread import ThreadAuthenticator
    public, private = _curve_pair(secret, "server")
    client_public, _ = _curve_pair(secret, "client")
    auth = ThreadAuthenticator(socket.context)
    auth.start()
    auth.configure_curve_callback("*", _AllowOne(client_public))
    socket.curve_secretkey = private
    socket.curve_publickey = public
    socket.curve_server = True
    return auth


def secure_client(socket: zmq.Socket, secret: str) -> None:
    """Make `socket` (not yet connected) a CURVE client of a `secure_server` socket."""
    server_public, _ = _curve_pair(secret, "server")
    public, private = _curve_pair(secret, "client")
    socket.curve_serverkey = server_public
    socket.curve_publickey = public
    socket.curve_secretkey = private


class _AllowOne:
    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(z85.encode(key) if len(key) == 32 else key,
                                   self.client_public)
