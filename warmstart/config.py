"""Settings: one frozen dataclass built from the environment (CONTRACT §2).

Explicit arguments to :func:`warmstart.enable` beat environment variables, which beat the defaults in
``_defaults.py``. Parsing is pure (``Settings.from_env(environ)``) so it is tested without touching
the process environment. Every bad value raises :class:`~warmstart.errors.ConfigError` whose message
is one line naming the variable, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from warmstart import _defaults
from warmstart.errors import ConfigError

MODES = ("rw", "ro", "off")
URL_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE_ACCEPTED = "a size such as 10GiB, 512MiB, 2GB or a number of bytes"


def parse_size(value: str, variable: str = "WARMSTART_CACHE_SIZE") -> int:
    """Parse ``10GiB`` / ``512M`` / ``2GB`` / ``1048576`` into bytes.

    Raises:
        ConfigError: the value is not a positive size.
    """
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ConfigError(variable, value, _SIZE_ACCEPTED)
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ConfigError(variable, value, _SIZE_ACCEPTED)
    return size


def validate_cache_url(url: str, variable: str = "WARMSTART_CACHE_URL") -> str:
    """Check that ``url`` is one of the accepted Redis URL forms and return it unchanged.

    Raises:
        ConfigError: unknown scheme, missing host, or a port that is not a number.
    """
    accepted = ("redis://[user:pass@]host:port[/db], rediss://... (TLS) or "
                "redis+cluster://host:port[,host:port...]")
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ConfigError(variable, url, accepted) from None
    if parts.scheme not in URL_SCHEMES or not parts.netloc:
        raise ConfigError(variable, url, accepted)
    hosts = parts.netloc.rsplit("@", 1)[-1]
    for hostport in hosts.split(","):
        host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "6379")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(variable, url, accepted)
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ConfigError(variable, url, accepted)
    compress = parse_qs(parts.query, keep_blank_values=True).get("compress")
    if compress is not None:
        compression_level(compress[-1], variable)
    return url


def compression_level(value: str, variable: str = "WARMSTART_CACHE_URL") -> int | None:
    """The remote tier's zstd level from the URL's ``compress=`` option: ``None`` for ``off``."""
    if value.strip().lower() == "off":
        return None
    try:
        level = int(value)
    except ValueError:
        level = None
    if level is None or not -100 <= level <= 22:
        raise ConfigError(f"{variable} option compress", value, "off or a zstd level from -100 (fastest) to 22")
    return level


def _default_cache_dir(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(base) / "warmstart"


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """Everything warmstart reads from the environment, parsed and checked."""

    enabled: bool = False
    """``WARMSTART=1``: turn the toolkit on in this process and its children."""
    cache_url: str | None = None
    """``WARMSTART_CACHE_URL``: the remote tier; ``None`` means local only."""
    cache_dir: Path = dataclasses.field(default_factory=lambda: _default_cache_dir(os.environ))
    """``WARMSTART_CACHE_DIR``: the local (diskcache) tier."""
    cache_size: int = _defaults.CACHE_SIZE_BYTES
    """``WARMSTART_CACHE_SIZE`` in bytes; least recently used entries are evicted past it."""
    mode: str = _defaults.CACHE_MODE
    """``WARMSTART_CACHE_MODE``: ``rw``, ``ro`` (never write) or ``off``."""
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    """``WARMSTART_SECRET`` / ``WARMSTART_SECRET_FILE``: HMAC key for remote entries."""
    namespace: str = ""
    """``WARMSTART_NAMESPACE``: extra namespace (team, trust domain)."""
    job_id: str = ""
    """``WARMSTART_JOB_ID``, else ``TORCHELASTIC_RUN_ID``, else generated."""
    run_dir: Path = Path("warmstart-runs")
    """``WARMSTART_RUN_DIR``: where this job's ETT events go."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> "Settings":
        """Build settings from ``environ`` (default ``os.environ``); keyword overrides win.

        Raises:
            ConfigError: a variable holds a value that is not accepted.
        """
        env = os.environ if environ is None else environ
        enabled_raw = env.get("WARMSTART", "")
        if enabled_raw not in ("", "0", "1"):
            raise ConfigError("WARMSTART", enabled_raw, "1 (on), 0 or unset (off)")
        mode = env.get("WARMSTART_CACHE_MODE", _defaults.CACHE_MODE).strip().lower() or _defaults.CACHE_MODE
        if mode not in MODES:
            raise ConfigError("WARMSTART_CACHE_MODE", env["WARMSTART_CACHE_MODE"], "one of rw, ro, off")
        url = env.get("WARMSTART_CACHE_URL", "").strip() or None
        if url is not None:
            validate_cache_url(url)
        size_raw = env.get("WARMSTART_CACHE_SIZE", "").strip()
        cache_size = parse_size(size_raw) if size_raw else _defaults.CACHE_SIZE_BYTES
        cache_dir = Path(env["WARMSTART_CACHE_DIR"]).expanduser() if env.get("WARMSTART_CACHE_DIR") else _default_cache_dir(env)
        secret = _read_secret(env)
        namespace = env.get("WARMSTART_NAMESPACE", "").strip()
        if namespace and not re.fullmatch(r"[A-Za-z0-9._\-]+", namespace):
            raise ConfigError("WARMSTART_NAMESPACE", namespace, "letters, digits, '.', '_' and '-'")
        job_id = env.get("WARMSTART_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or ""
        if job_id in ("", "none"):  # torchrun sets TORCHELASTIC_RUN_ID=none when no --rdzv-id is given
            job_id = ""
        run_dir_raw = env.get("WARMSTART_RUN_DIR", "")
        values: dict[str, object] = dict(
            enabled=enabled_raw == "1", cache_url=url, cache_dir=cache_dir, cache_size=cache_size,
            mode=mode, secret=secret, namespace=namespace, job_id=job_id,
            run_dir=Path(run_dir_raw) if run_dir_raw else Path("warmstart-runs") / (job_id or "unnamed"),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def _read_secret(env: Mapping[str, str]) -> bytes | None:
    if env.get("WARMSTART_SECRET"):
        return env["WARMSTART_SECRET"].encode()
    path = env.get("WARMSTART_SECRET_FILE", "").strip()
    if not path:
        return None
    try:
        secret = Path(path).expanduser().read_bytes().strip()
    except OSError as exc:
        raise ConfigError("WARMSTART_SECRET_FILE", path, f"a readable file holding the key ({exc.strerror})") from None
    if not secret:
        raise ConfigError("WARMSTART_SECRET_FILE", path, "a file holding a non-empty key")
    return secret


def new_job_id() -> str:
    """A fresh job id for a job whose launcher gave none."""
    return "job-" + uuid.uuid4().hex[:12]
