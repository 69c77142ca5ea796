"""Signed envelopes for the remote tier.

Torch unpickles and executes what its caches hold, so whoever can write to the shared cache could run
code in every job that reads it. Every remote entry is therefore a small *pointer record* signed with
HMAC-SHA256 under the job's secret, naming the namespace, kind and key it belongs to and the SHA-256
of the (compressed) blob it points to. A reader verifies the signature, fetches the blob and checks
its digest before a single byte is decompressed, let alone handed to torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

from warmstart.errors import IntegrityError

MAGIC = b"WSP1"
_MAC_LEN = 32


@dataclass(frozen=True, slots=True)
class Pointer:
    """What a signed pointer record says about the blob it names."""

    namespace: str
    kind: str
    key: str
    digest: str
    """SHA-256 (hex) of the stored blob bytes."""
    size: int
    """Length of the stored blob (compressed) in bytes."""
    chunks: int
    compressed: bool
    cost_s: float
    """Seconds it took to produce the artifact (for the "seconds saved" estimate)."""


def sign(secret: bytes, pointer: Pointer) -> bytes:
    """Serialize and sign ``pointer``."""
    body = json.dumps(
        [pointer.namespace, pointer.kind, pointer.key, pointer.digest, pointer.size, pointer.chunks,
         pointer.compressed, round(pointer.cost_s, 4)],
        separators=(",", ":"),
    ).encode()
    return MAGIC + hmac.new(secret, body, hashlib.sha256).digest() + body


def verify(secret: bytes, record: bytes, *, namespace: str, kind: str, key: str) -> Pointer:
    """Check a pointer record's signature and that it belongs to ``(namespace, kind, key)``.

    Raises:
        IntegrityError: bad magic, bad signature, or a record signed for another key.
    """
    if len(record) < len(MAGIC) + _MAC_LEN or not record.startswith(MAGIC):
        raise IntegrityError("not a warmstart pointer record")
    mac, body = record[len(MAGIC):len(MAGIC) + _MAC_LEN], record[len(MAGIC) + _MAC_LEN:]
    if not hmac.compare_digest(mac, hmac.new(secret, body, hashlib.sha256).digest()):
        raise IntegrityError("signature does not verify (wrong secret or tampered entry)")
    try:
        ns, k, key_, digest, size, chunks, compressed, cost = json.loads(body)
    except ValueError as exc:  # signed but unparsable: a writer bug, still never trusted
        raise IntegrityError(f"unparsable pointer record: {exc}") from None
    if (ns, k, key_) != (namespace, kind, key):
        raise IntegrityError("pointer record was signed for another key")
    return Pointer(ns, k, key_, digest, int(size), int(chunks), bool(compressed), float(cost))


def blob_digest(blob: bytes) -> str:
    """The content address of a blob."""
    return hashlib.sha256(blob).hexdigest()


def check_blob(pointer: Pointer, blob: bytes) -> None:
    """Raise :class:`IntegrityError` unless ``blob`` is exactly what ``pointer`` names."""
    if len(blob) != pointer.size or not hmac.compare_digest(blob_digest(blob), pointer.digest):
        raise IntegrityError("blob checksum does not match its signed pointer")
