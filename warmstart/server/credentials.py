"""Passwords and the signing secret of one server directory.

This module owns the secret files under ``--dir``: one password per ACL user and the HMAC key that
signs cache entries (what users point ``WARMSTART_SECRET_FILE`` at). They are generated once, with
mode 0600, and read back on every later start from the same directory, so URLs and signatures
stay valid across restarts; :func:`rotate` replaces them on purpose. It never prints or logs a
secret.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path

from warmstart.server.acl import USERS

SECRET_FILE = "secret.key"
PASSWORD_FILE = "{user}.password"


@dataclasses.dataclass(frozen=True)
class Credentials:
    """The generated secrets of one server directory."""

    passwords: dict[str, str] = dataclasses.field(repr=False)
    """ACL user name -> password (URL-safe characters only)."""
    secret_file: Path
    """File holding the HMAC signing key (hex)."""

    @classmethod
    def load_or_create(cls, directory: Path) -> "Credentials":
        """Read the secrets in ``directory``, generating any that are missing.

        Raises:
            OSError: the directory cannot be written or a file cannot be read.
        """
        passwords = {user: _read_or_create(directory / PASSWORD_FILE.format(user=user),
                                           lambda: secrets.token_urlsafe(32)) for user in USERS}
        secret_file = directory / SECRET_FILE
        _read_or_create(secret_file, lambda: secrets.token_hex(32))
        return cls(passwords=passwords, secret_file=secret_file)

    @classmethod
    def load(cls, directory: Path) -> "Credentials":
        """Read existing secrets (no generation), for ``status`` and ``stop``.

        Raises:
            OSError: a file is missing or unreadable.
        """
        passwords = {user: (directory / PASSWORD_FILE.format(user=user)).read_text().strip() for user in USERS}
        return cls(passwords=passwords, secret_file=directory / SECRET_FILE)


def rotate(directory: Path, users: tuple[str, ...] = (), secret: bool = False) -> Credentials:
    """Replace the passwords of ``users`` and/or the signing secret with fresh ones.

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
    return Credentials.load(directory)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the owner only (0600), replacing it atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o600)  # the umask or an existing file may have left it wider
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
