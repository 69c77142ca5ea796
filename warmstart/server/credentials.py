"""Passwords and signing keys of one server directory.

This module owns the secret files under ``--dir``: one password per ACL user, the Ed25519 key pair
that signs cache entries (``signing.key``, 0600, for writer jobs' ``WARMSTART_KEY_FILE``;
``verify.pub``, 0644, for readers') and the HMAC secret of older setups (``secret.key``, for
``WARMSTART_SECRET_FILE``). They are generated once and read back on every later start from the
same directory, so URLs and signatures stay valid across restarts; :func:`rotate` replaces them on
purpose. It never prints or logs a secret.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path

from warmstart._fileio import write_private  # re-exported: state.py, process.py and others import it from here
from warmstart.server.acl import USERS

SECRET_FILE = "secret.key"
SIGNING_KEY_FILE = "signing.key"
VERIFY_KEY_FILE = "verify.pub"
PASSWORD_FILE = "{user}.password"


@dataclasses.dataclass(frozen=True)
class Credentials:
    """The generated secrets of one server directory."""

    passwords: dict[str, str] = dataclasses.field(repr=False)
    """ACL user name -> password (URL-safe characters only)."""
    secret_file: Path
    """File holding the HMAC signing key (hex), for setups from before key pairs."""
    signing_key_file: Path
    """Ed25519 private key (PEM, 0600): ``WARMSTART_KEY_FILE`` of jobs that write entries."""
    verify_key_file: Path
    """Its public key (PEM): ``WARMSTART_KEY_FILE`` of jobs that only read."""

    @classmethod
    def load_or_create(cls, directory: Path) -> Credentials:
        """Read the secrets in ``directory``, generating any that are missing.

        Raises:
            OSError: the directory cannot be written or a file cannot be read.
        """
        passwords = {
            user: _read_or_create(directory / PASSWORD_FILE.format(user=user), lambda: secrets.token_urlsafe(32))
            for user in USERS
        }
        secret_file = directory / SECRET_FILE
        _read_or_create(secret_file, lambda: secrets.token_hex(32))
        ensure_key_pair(directory)
        return cls(
            passwords=passwords,
            secret_file=secret_file,
            signing_key_file=directory / SIGNING_KEY_FILE,
            verify_key_file=directory / VERIFY_KEY_FILE,
        )

    @classmethod
    def load(cls, directory: Path) -> Credentials:
        """Read existing secrets (no generation), for ``status`` and ``stop``.

        Raises:
            OSError: a file is missing or unreadable.
        """
        passwords = {user: (directory / PASSWORD_FILE.format(user=user)).read_text().strip() for user in USERS}
        return cls(
            passwords=passwords,
            secret_file=directory / SECRET_FILE,
            signing_key_file=directory / SIGNING_KEY_FILE,
            verify_key_file=directory / VERIFY_KEY_FILE,
        )

    def key_id(self) -> str:
        """Key id of the Ed25519 key pair (what pointer keys of its entries carry)."""
        from warmstart.compile_cache.signing import load_key_file

        return load_key_file(self.verify_key_file).key_id


def ensure_key_pair(directory: Path) -> None:
    """Create the Ed25519 key pair in ``directory`` unless ``signing.key`` exists; (re)write
    ``verify.pub`` from it when missing or not matching, and narrow a widened ``signing.key``.

    Raises:
        OSError: a file cannot be written.
        OptionError: ``signing.key`` exists but is no Ed25519 private key.
    """
    from warmstart.compile_cache import signing
    from warmstart.errors import ConfigError
    from warmstart.server.config import OptionError

    private, public = directory / SIGNING_KEY_FILE, directory / VERIFY_KEY_FILE
    if not private.exists():
        signing.generate_key_pair(private, public)
        return
    try:
        keys = signing.load_key_file(private)
    except ConfigError:
        keys = None
    if keys is None or not keys.can_sign:
        raise OptionError(
            "--dir",
            str(directory),
            "a directory whose signing.key is an Ed25519 private key",
            f"{private} is not an Ed25519 private key in PEM: restore it, or remove it (and "
            f"{VERIFY_KEY_FILE}) to generate a new key pair (jobs then need the new files)",
        )
    if private.stat().st_mode & 0o077:
        os.chmod(private, 0o600)  # someone widened it; a private key must not stay readable by others
    try:
        current = public.read_bytes()
    except FileNotFoundError:
        current = b""
    if current != keys.public_pem():
        from warmstart._fileio import write_file

        write_file(public, keys.public_pem(), 0o644)


def rotate(directory: Path, users: tuple[str, ...] = (), secret: bool = False, key_pair: bool = False) -> Credentials:
    """Replace the passwords of ``users``, the HMAC secret and/or the Ed25519 key pair with fresh ones.

    Only the files change; :func:`warmstart.server.process.reload_acl` makes a running server
    accept the new passwords.

    Raises:
        ValueError: an unknown user name.
        OSError: a file cannot be written.
    """
    for user in users:
        if user not in USERS:
            raise ValueError(f"unknown user {user!r}: expected one of {', '.join(USERS)}")
        write_private(directory / PASSWORD_FILE.format(user=user), secrets.token_urlsafe(32) + "\n")
    if secret:
        write_private(directory / SECRET_FILE, secrets.token_hex(32) + "\n")
    if key_pair:
        from warmstart.compile_cache import signing

        signing.generate_key_pair(directory / SIGNING_KEY_FILE, directory / VERIFY_KEY_FILE)
    return Credentials.load(directory)


def _read_or_create(path: Path, make) -> str:
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        value = ""
    if not value:
        value = make()
        write_private(path, value + "\n")
    elif path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)  # someone widened it; a secret must not stay world-readable
    return value
