"""Signed envelopes for the remote tier.

Torch unpickles and executes what its caches hold, so whoever can write to the shared cache could run
code in every job that reads it. Every remote entry is therefore a *pointer record*, signed, naming the
namespace, kind and key it belongs to and either carrying a small value inline (covered by the
signature) or naming the BLAKE3 digest of the (compressed) blob it points to. A reader verifies the
signature, and the blob's digest, before a single byte is decompressed, let alone handed to torch.
BLAKE3 rather than SHA-256 for blobs: as collision resistant, and twice as fast here (0.48 vs 0.77 CPU
s per GiB, even against SHA-NI), which a reader pays on every byte it fetches.

Two signature schemes, both behind :class:`Keys`:

* :class:`Ed25519Keys` (``WARMSTART_KEY_FILE``): writers hold the private key (``signing.key``),
  readers only the public key (``verify.pub``) and so cannot sign anything. A leaked reader file
  plus a leaked writer *password* still cannot get code into a job. Records start with ``WSE1``.
* :class:`HmacKeys` (``WARMSTART_SECRET[_FILE]``): one symmetric secret that every job, reader or
  writer, holds, so any holder can sign. Kept for existing setups. Records start with ``WSP3``.

A record of the other scheme never verifies (:class:`IntegrityError`); in practice jobs of the two
schemes never even meet, since pointer keys carry the signer's key id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import blake3

from warmstart.errors import ConfigError, IntegrityError

MAGIC = b"WSP3"
"""Magic of HMAC-SHA256 records (the original format)."""
ED25519_MAGIC = b"WSE1"
"""Magic of Ed25519 records: magic, 64-byte signature over magic + body, body."""
_MAC_LEN = 32
_SIG_LEN = 64
_LEN = 4  # bytes of the header-length field
KEY_FILE_VARIABLE = "WARMSTART_KEY_FILE"


@dataclass(frozen=True, slots=True)
class Pointer:
    """What a signed pointer record says about the blob it names."""

    namespace: str
    kind: str
    key: str
    digest: str
    """BLAKE3 (hex) of the stored blob bytes; empty when the value is inline."""
    size: int
    """Length of the stored blob (compressed) in bytes."""
    chunks: int
    """Number of blob chunks; 0 when the value is inline in the record."""
    compressed: bool
    cost_s: float
    """Seconds it took to produce the artifact (for the "seconds saved" estimate)."""


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """What a signed lease says: which entry, whose (a random token per holder) and until when."""

    namespace: str
    kind: str
    key: str
    token: str
    expires_ms: int
    """Unix time in milliseconds after which nobody honours the lease, whatever Redis still holds."""


_LEASE_TAG = "lease"


def _lease_body(lease: LeaseRecord) -> bytes:
    header = json.dumps(
        [_LEASE_TAG, lease.namespace, lease.kind, lease.key, lease.token, int(lease.expires_ms)], separators=(",", ":")
    ).encode()
    return len(header).to_bytes(_LEN, "big") + header


def _parse_lease(body: bytes, *, namespace: str, kind: str, key: str) -> LeaseRecord:
    header_len = int.from_bytes(body[:_LEN], "big")
    try:
        tag, ns, k, key_, token, expires = json.loads(body[_LEN : _LEN + header_len])
    except (ValueError, TypeError) as exc:
        raise IntegrityError(f"not a lease record: {exc}") from None
    if tag != _LEASE_TAG or (ns, k, key_) != (namespace, kind, key) or len(body) != _LEN + header_len:
        raise IntegrityError("lease record was signed for another entry")
    return LeaseRecord(ns, k, key_, str(token), int(expires))


def key_id(secret: bytes) -> str:
    """A short public id of ``secret`` (8 hex digits of an HMAC; reveals nothing usable about it).

    Pointer keys include it, so jobs holding different secrets (a rotation under way, a job given
    the wrong file) keep to separate keys: they miss each other's entries instead of overwriting
    them. Under a job's own key id, a record that does not verify was tampered with or damaged.
    """
    return hmac.new(secret, b"warmstart key id", hashlib.sha256).hexdigest()[:8]


def _body(pointer: Pointer, inline: bytes) -> bytes:
    header = json.dumps(
        [
            pointer.namespace,
            pointer.kind,
            pointer.key,
            pointer.digest,
            pointer.size,
            pointer.chunks,
            pointer.compressed,
            round(pointer.cost_s, 4),
        ],
        separators=(",", ":"),
    ).encode()
    return len(header).to_bytes(_LEN, "big") + header + inline


def sign(secret: bytes, pointer: Pointer, inline: bytes = b"") -> bytes:
    """Serialize and HMAC-sign ``pointer``, with ``inline`` (the stored value itself, for small ones)."""
    body = _body(pointer, inline)
    return MAGIC + hmac.new(secret, body, hashlib.sha256).digest() + body


def verify(secret: bytes, record: bytes, *, namespace: str, kind: str, key: str) -> tuple[Pointer, bytes]:
    """Check an HMAC pointer record's signature and that it belongs to ``(namespace, kind, key)``.

    Returns:
        The pointer and its inline value (empty when the value is in a blob).

    Raises:
        IntegrityError: bad magic, bad signature, or a record signed for another key.
    """
    if record.startswith(ED25519_MAGIC):
        raise IntegrityError("record is Ed25519-signed; this job verifies HMAC signatures only")
    if len(record) < len(MAGIC) + _MAC_LEN + _LEN or not record.startswith(MAGIC):
        raise IntegrityError("not a warmstart pointer record")
    mac, body = record[len(MAGIC) : len(MAGIC) + _MAC_LEN], record[len(MAGIC) + _MAC_LEN :]
    if not hmac.compare_digest(mac, hmac.new(secret, body, hashlib.sha256).digest()):
        raise IntegrityError("signature does not verify (wrong secret or tampered entry)")
    return _parse(body, namespace=namespace, kind=kind, key=key)


def _parse(body: bytes, *, namespace: str, kind: str, key: str) -> tuple[Pointer, bytes]:
    """The pointer and inline value of a *verified* body, checked against ``(namespace, kind, key)``."""
    header_len = int.from_bytes(body[:_LEN], "big")
    try:
        ns, k, key_, digest, size, chunks, compressed, cost = json.loads(body[_LEN : _LEN + header_len])
    except (ValueError, TypeError) as exc:  # signed but unparsable: a writer bug, still never trusted
        raise IntegrityError(f"unparsable pointer record: {exc}") from None
    if (ns, k, key_) != (namespace, kind, key):
        raise IntegrityError("pointer record was signed for another key")
    inline = body[_LEN + header_len :]
    pointer = Pointer(ns, k, key_, digest, int(size), int(chunks), bool(compressed), float(cost))
    if pointer.chunks == 0 and len(inline) != pointer.size:
        raise IntegrityError("inline value has the wrong length")
    return pointer, inline


def blob_digest(blob: bytes) -> str:
    """The content address of a blob (BLAKE3, 256 bits, hex)."""
    return blake3.blake3(blob).hexdigest()


def check_blob(pointer: Pointer, blob: bytes) -> None:
    """Raise :class:`IntegrityError` unless ``blob`` is exactly what ``pointer`` names."""
    if len(blob) != pointer.size or not hmac.compare_digest(blob_digest(blob), pointer.digest):
        raise IntegrityError("blob checksum does not match its signed pointer")


# -- keys ------------------------------------------------------------------------------------------


class Keys:
    """What a job signs and verifies pointer records with.

    Attributes:
        scheme: ``"ed25519"`` or ``"hmac-sha256"``.
        key_id: 8 hex digits naming the key (pointer keys carry it; it reveals nothing secret).
        can_sign: whether this job may write entries. False for a verify-only (public) key: such a
            job never writes to the remote tier, whatever its Redis credentials allow.
    """

    scheme: str = ""
    key_id: str = ""
    can_sign: bool = False

    def sign(self, pointer: Pointer, inline: bytes = b"") -> bytes:
        """The signed record of ``pointer`` (with ``inline``, the value itself for small ones).

        Raises:
            PermissionError: these keys can only verify.
        """
        raise NotImplementedError

    def verify(self, record: bytes, *, namespace: str, kind: str, key: str) -> tuple[Pointer, bytes]:
        """Check ``record``'s signature and that it belongs to ``(namespace, kind, key)``.

        Returns:
            The pointer and its inline value (empty when the value is in a blob).

        Raises:
            IntegrityError: another scheme's record, bad signature, or a record for another key.
        """
        raise NotImplementedError

    def sign_lease(self, lease: LeaseRecord) -> bytes:
        """The signed record of ``lease``, sealed like a pointer record (another body: never taken for one).

        Raises:
            PermissionError: these keys can only verify.
        """
        return self._seal(_lease_body(lease))

    def verify_lease(self, record: bytes, *, namespace: str, kind: str, key: str) -> LeaseRecord:
        """The lease in ``record`` if its signature verifies under these keys and it is for
        ``(namespace, kind, key)``.

        Raises:
            IntegrityError: anything else (unsigned, another key's, another entry's, a pointer record).
        """
        return _parse_lease(self._open(record), namespace=namespace, kind=kind, key=key)

    def _seal(self, body: bytes) -> bytes:
        raise NotImplementedError

    def _open(self, record: bytes) -> bytes:
        raise NotImplementedError

    def __repr__(self) -> str:  # never shows key material
        return f"<{type(self).__name__} {self.scheme} key id {self.key_id}{'' if self.can_sign else ', verify only'}>"


class HmacKeys(Keys):
    """A symmetric HMAC-SHA256 secret (``WARMSTART_SECRET[_FILE]``): whoever verifies can also sign."""

    scheme = "hmac-sha256"
    can_sign = True

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("an HMAC secret must not be empty")
        self._secret = bytes(secret)
        self.key_id = key_id(self._secret)

    def sign(self, pointer: Pointer, inline: bytes = b"") -> bytes:
        return sign(self._secret, pointer, inline)

    def verify(self, record: bytes, *, namespace: str, kind: str, key: str) -> tuple[Pointer, bytes]:
        return verify(self._secret, record, namespace=namespace, kind=kind, key=key)

    def _seal(self, body: bytes) -> bytes:
        return MAGIC + hmac.new(self._secret, body, hashlib.sha256).digest() + body

    def _open(self, record: bytes) -> bytes:
        if len(record) < len(MAGIC) + _MAC_LEN + _LEN or not record.startswith(MAGIC):
            raise IntegrityError("not an HMAC-signed warmstart record")
        mac, body = record[len(MAGIC) : len(MAGIC) + _MAC_LEN], record[len(MAGIC) + _MAC_LEN :]
        if not hmac.compare_digest(mac, hmac.new(self._secret, body, hashlib.sha256).digest()):
            raise IntegrityError("signature does not verify (wrong secret or tampered record)")
        return body


# DER of the two Ed25519 PEM forms OpenSSL and `cryptography` write (RFC 8410): a fixed prefix and
# the 32 key bytes. Recognised without importing cryptography's serialization package (~15-20 ms
# that every process building a store would pay); anything else goes through it.
_PKCS8_ED25519 = bytes.fromhex("302e020100300506032b657004220420")
_SPKI_ED25519 = bytes.fromhex("302a300506032b6570032100")
_PEM_RE = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\s*(.*?)\s*-----END \1-----", re.S)
KEY_FILE_ACCEPTED = (
    "a PEM file holding an Ed25519 private key (signing.key: signs and verifies) or public key "
    "(verify.pub: verifies only), e.g. from `warmstart server start` or "
    "`openssl genpkey -algorithm ed25519`"
)


class Ed25519Keys(Keys):
    """An Ed25519 key pair, or only its public half (``WARMSTART_KEY_FILE``).

    With the private key a job signs and verifies; with the public key alone it verifies and can
    never sign, so handing ``verify.pub`` to every reader gives none of them the power to write
    entries other jobs would trust.
    """

    scheme = "ed25519"

    def __init__(self, *, private_key=None, public_key=None) -> None:
        if private_key is None and public_key is None:
            raise ValueError("Ed25519Keys needs a private or a public key")
        if private_key is not None:
            public_key = private_key.public_key()
        from cryptography.exceptions import InvalidSignature

        self._invalid = InvalidSignature
        self._private = private_key
        self._public = public_key
        self.can_sign = private_key is not None
        self.public_bytes = _raw_public(public_key)
        self.key_id = hashlib.sha256(b"warmstart ed25519 key id\0" + self.public_bytes).hexdigest()[:8]

    @classmethod
    def generate(cls) -> Ed25519Keys:
        from cryptography.hazmat.primitives.asymmetric import ed25519

        return cls(private_key=ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, data: bytes) -> Ed25519Keys:
        """Keys from PEM text: a PKCS#8 private key or a SubjectPublicKeyInfo public key.

        Raises:
            ValueError: not PEM, an encrypted or non-Ed25519 key (the message says which).
        """
        from cryptography.hazmat.primitives.asymmetric import ed25519

        match = _PEM_RE.search(data)
        if not match:
            raise ValueError("no PEM block")
        label = match.group(1).decode()
        try:
            der = base64.b64decode(b"".join(match.group(2).split()), validate=True)
        except ValueError:
            raise ValueError(f"a PEM {label} block that is not valid base64") from None
        if label == "PRIVATE KEY":
            if len(der) == len(_PKCS8_ED25519) + 32 and der.startswith(_PKCS8_ED25519):
                return cls(private_key=ed25519.Ed25519PrivateKey.from_private_bytes(der[-32:]))
            from cryptography.hazmat.primitives import serialization

            try:
                key = serialization.load_der_private_key(der, password=None)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"unreadable private key ({_first_line(exc)})") from None
            if not isinstance(key, ed25519.Ed25519PrivateKey):
                raise ValueError(f"a {_algorithm(key)} private key, not Ed25519")
            return cls(private_key=key)
        if label == "PUBLIC KEY":
            if len(der) == len(_SPKI_ED25519) + 32 and der.startswith(_SPKI_ED25519):
                return cls(public_key=ed25519.Ed25519PublicKey.from_public_bytes(der[-32:]))
            from cryptography.hazmat.primitives import serialization

            try:
                public = serialization.load_der_public_key(der)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"unreadable public key ({_first_line(exc)})") from None
            if not isinstance(public, ed25519.Ed25519PublicKey):
                raise ValueError(f"a {_algorithm(public)} public key, not Ed25519")
            return cls(public_key=public)
        if label == "ENCRYPTED PRIVATE KEY":
            raise ValueError("an encrypted private key (store it unencrypted, mode 0600)")
        if label == "OPENSSH PRIVATE KEY":
            raise ValueError("an OpenSSH private key (convert it to PKCS#8 PEM)")
        raise ValueError(f"a PEM {label} block")

    def private_pem(self) -> bytes:
        """PKCS#8 PEM of the private key (unencrypted: protect the file, mode 0600)."""
        if self._private is None:
            raise PermissionError(f"Ed25519 key {self.key_id}: only the public key is held")
        from cryptography.hazmat.primitives import serialization

        return self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def public_pem(self) -> bytes:
        """SubjectPublicKeyInfo PEM of the public key (what readers get: ``verify.pub``)."""
        der = _SPKI_ED25519 + self.public_bytes
        b64 = base64.b64encode(der).decode()
        return ("-----BEGIN PUBLIC KEY-----\n" + b64 + "\n-----END PUBLIC KEY-----\n").encode()

    def verify_only(self) -> Ed25519Keys:
        """The same keys without the private half."""
        return Ed25519Keys(public_key=self._public)

    def sign(self, pointer: Pointer, inline: bytes = b"") -> bytes:
        return self._seal(_body(pointer, inline))

    def _seal(self, body: bytes) -> bytes:
        if self._private is None:
            raise PermissionError(f"Ed25519 key {self.key_id} is verify-only: this job cannot sign entries")
        return ED25519_MAGIC + self._private.sign(ED25519_MAGIC + body) + body

    def _open(self, record: bytes) -> bytes:
        if len(record) < len(ED25519_MAGIC) + _SIG_LEN + _LEN or not record.startswith(ED25519_MAGIC):
            raise IntegrityError("not an Ed25519-signed warmstart record")
        signature = record[len(ED25519_MAGIC) : len(ED25519_MAGIC) + _SIG_LEN]
        body = record[len(ED25519_MAGIC) + _SIG_LEN :]
        try:
            self._public.verify(signature, ED25519_MAGIC + body)
        except self._invalid:
            raise IntegrityError("signature does not verify (another key or a tampered record)") from None
        return body

    def verify(self, record: bytes, *, namespace: str, kind: str, key: str) -> tuple[Pointer, bytes]:
        if record.startswith(MAGIC):
            raise IntegrityError("record is HMAC-signed; this job verifies Ed25519 signatures only")
        return _parse(self._open(record), namespace=namespace, kind=kind, key=key)


def load_key_file(path: str | os.PathLike) -> Ed25519Keys:
    """The keys in ``path`` (``WARMSTART_KEY_FILE``): an Ed25519 private key signs and verifies, a
    public key only verifies.

    Raises:
        ConfigError: unreadable, or not one of the accepted forms (one line naming the variable,
            the path and what is accepted).
    """
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            KEY_FILE_VARIABLE,
            str(path),
            f"{KEY_FILE_ACCEPTED}; it cannot be read ({exc.strerror or type(exc).__name__})",
        ) from None
    try:
        return Ed25519Keys.from_pem(data)
    except ValueError as exc:
        raise ConfigError(KEY_FILE_VARIABLE, str(path), f"{KEY_FILE_ACCEPTED}; found {_first_line(exc)}") from None


def keys_for(key_file: str | os.PathLike | None, secret: bytes | None) -> Keys | None:
    """The keys a job signs and verifies with: ``key_file`` (Ed25519) when set, else ``secret``
    (HMAC), else ``None`` (no remote tier).

    Raises:
        ConfigError: the key file cannot be read or holds no Ed25519 key.
    """
    if key_file:
        return load_key_file(key_file)
    return HmacKeys(secret) if secret else None


def generate_key_pair(private_path: str | os.PathLike, public_path: str | os.PathLike) -> Ed25519Keys:
    """Make a new Ed25519 key pair: the private key to ``private_path`` (0600), the public key to
    ``public_path`` (0644: it is no secret). Both files are replaced atomically."""
    from warmstart._fileio import write_file

    keys = Ed25519Keys.generate()
    write_file(Path(private_path), keys.private_pem(), 0o600)
    write_file(Path(public_path), keys.public_pem(), 0o644)
    return keys


def _raw_public(public_key) -> bytes:
    return public_key.public_bytes_raw()


def _algorithm(key: object) -> str:
    return type(key).__name__.removeprefix("_").replace("PrivateKey", "").replace("PublicKey", "") or "non-Ed25519"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
