"""Settings: the one place warmstart reads its environment variables (docs/reference.md#environment).

:class:`Settings` holds what a job's cache and metrics need; :func:`job_identity` the few fields
that say which job, rank and attempt a process belongs to (read on their own so that recording
events never depends on the cache's settings); :func:`metrics_settings` where live metrics go;
:func:`server_settings` what ``warmstart server`` reads. Explicit arguments to :func:`warmstart.enable` beat
environment variables, which beat the defaults in
``_defaults.py``. Parsing is pure (``Settings.from_env(environ)``) so it is tested without touching
the process environment. Every bad value raises :class:`~warmstart.errors.ConfigError` whose message
is one line naming the variable, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import uuid
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from warmstart import _defaults
from warmstart.errors import ConfigError

MODES = ("rw", "ro", "off")
URL_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
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
        ConfigError: unknown scheme, missing host, a port that is not a number, or a query option
            that is unknown or has a bad value (the message shows the URL with its password redacted).
    """
    accepted = "redis://[user:pass@]host:port[/db], rediss://... (TLS) or redis+cluster://host:port[,host:port...]"
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ConfigError(variable, redact_url(url), accepted) from None
    if parts.scheme not in URL_SCHEMES or not parts.netloc:
        raise ConfigError(variable, redact_url(url), accepted)
    if "@" in parts.query or "@" in parts.fragment:  # the password holds a '?' or '#': never echo a part of it
        raise ConfigError(
            variable, redact_url(url), accepted + ", with a '?' or '#' in the password percent-encoded (%3F, %23)"
        )
    hosts = parts.netloc.rsplit("@", 1)[-1]
    for hostport in hosts.split(","):
        host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "6379")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(variable, redact_url(url), accepted)
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ConfigError(variable, redact_url(url), accepted)
    for name, values in parse_qs(parts.query, keep_blank_values=True).items():
        _check_url_option(name, values[-1], variable)
    return url


_SECONDS = "a number of seconds greater than 0"
#: Query options a cache URL may carry, and what each accepts. Checked here so that a bad one is a
#: setting error at start-up, never an exception inside torch when the store is first built.
URL_OPTIONS: dict[str, str] = {
    "compress": "off or a zstd level from -100 (fastest) to 22",
    "socket_timeout": _SECONDS,
    "socket_connect_timeout": _SECONDS,
    "ssl_ca_certs": "a file path",
    "ssl_certfile": "a file path",
    "ssl_keyfile": "a file path",
    "ssl_cert_reqs": "one of none, optional, required",
    "ssl_check_hostname": "one of 1, 0, true, false, yes, no",
}


def url_options(url: str) -> dict[str, object]:
    """The query options of a checked cache URL, parsed: ``compress`` as a zstd level or ``None``
    (off), timeouts as floats, ``ssl_check_hostname`` as a bool, the rest as strings. Options
    not given are left out."""
    parsed: dict[str, object] = {}
    for name, values in parse_qs(urlsplit(url).query, keep_blank_values=True).items():
        value = values[-1]
        _check_url_option(name, value, "WARMSTART_CACHE_URL")
        if name == "compress":
            parsed[name] = compression_level(value)
        elif URL_OPTIONS[name] == _SECONDS:
            parsed[name] = float(value)
        elif name == "ssl_check_hostname":
            parsed[name] = value.lower() in ("1", "true", "yes")
        else:
            parsed[name] = value
    return parsed


def _check_url_option(name: str, value: str, variable: str) -> None:
    accepted = URL_OPTIONS.get(name)
    if accepted is None:
        raise ConfigError(f"{variable} option", name, "one of " + ", ".join(URL_OPTIONS))
    if name == "compress":
        compression_level(value, variable)
        return
    if accepted == _SECONDS:
        try:
            ok = 0 < float(value) < float("inf")
        except ValueError:
            ok = False
    elif name == "ssl_cert_reqs":
        ok = value in ("none", "optional", "required")
    elif name == "ssl_check_hostname":
        ok = value.lower() in ("1", "0", "true", "false", "yes", "no")
    else:
        ok = bool(value)
    if not ok:
        raise ConfigError(f"{variable} option {name}", value, accepted)


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (the whole user part when it has no ``:``), for
    messages and logs. Works on malformed URLs too: it never parses more than it must."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    query_at = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, query_at)
    if at < 0:
        at = rest.rfind("@")  # a '?' or '#' in the password itself: over-redact rather than leak
    if at < 0:
        return url
    user, colon, _ = rest[:at].partition(":")
    userinfo = f"{user}:***" if colon else "***"
    return f"{scheme}{sep}{userinfo}{rest[at:]}"


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
class JobIdentity:
    """Which job, rank and attempt this process belongs to, and where its ETT events go."""

    enabled: bool
    """``WARMSTART=1``."""
    job_id: str
    """``WARMSTART_JOB_ID``, else ``TORCHELASTIC_RUN_ID`` (unless torchrun's ``none``); empty when neither."""
    run_dir: Path | None
    """``WARMSTART_RUN_DIR``; ``None`` when unset (the recorder then uses ``warmstart-runs/<job id>``)."""
    rank: int
    """``RANK`` (torchrun's global rank), else 0."""
    attempt: int
    """``WARMSTART_ATTEMPT``, else ``TORCHELASTIC_RESTART_COUNT``, else 0."""
    quiet_errors: bool
    """``WARMSTART_QUIET_ERRORS=1``: a parent already printed why warmstart is off; say nothing."""
    given_job_id: str = ""
    """``WARMSTART_JOB_ID`` alone, empty when unset. It names Dynamo's PGO state, which repeats of a
    job share: torchrun's run id, new on every launch, must not."""


def job_identity(environ: Mapping[str, str] | None = None) -> JobIdentity:
    """The job identity from ``environ`` (default ``os.environ``).

    Raises:
        ConfigError: ``RANK``, ``WARMSTART_ATTEMPT`` or ``TORCHELASTIC_RESTART_COUNT`` is not an integer.
    """
    env = os.environ if environ is None else environ
    job_id = env.get("WARMSTART_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or ""
    if job_id == "none":  # torchrun sets TORCHELASTIC_RUN_ID=none when no --rdzv-id is given
        job_id = ""
    run_dir = env.get("WARMSTART_RUN_DIR", "").strip()
    if env.get("WARMSTART_ATTEMPT", "").strip():
        attempt = _env_int(env, "WARMSTART_ATTEMPT", 0, minimum=0)
    else:
        attempt = _env_int(env, "TORCHELASTIC_RESTART_COUNT", 0, minimum=0)
    return JobIdentity(
        enabled=env.get("WARMSTART", "") == "1",
        job_id=job_id,
        run_dir=Path(run_dir).expanduser() if run_dir else None,
        rank=_env_int(env, "RANK", 0, minimum=-1),
        attempt=attempt,
        quiet_errors=quiet_errors(env),
        given_job_id=env.get("WARMSTART_JOB_ID", ""),
    )


def metrics_on(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process records ETT events: ``WARMSTART=1`` or ``WARMSTART_RUN_DIR`` set.
    Never raises, so that a malformed rank matters only to jobs that record."""
    env = os.environ if environ is None else environ
    if env.get("WARMSTART_COMPILE_WORKER") == "1":  # a background compile's worker is not the job
        return False
    return env.get("WARMSTART", "") == "1" or bool(env.get("WARMSTART_RUN_DIR", "").strip())


def ensure_job_id(identity: JobIdentity) -> str:
    """``identity``'s job id; a job without one gets one now, exported as ``WARMSTART_JOB_ID`` so that
    its other processes (and child processes) use the same."""
    if identity.job_id:
        return identity.job_id
    job_id = os.environ["WARMSTART_JOB_ID"] = new_job_id()
    return job_id


def job_run_dir(identity: JobIdentity, job_id: str) -> Path:
    """Where a job's ETT events and cache-miss log go: ``WARMSTART_RUN_DIR``, else
    ``warmstart-runs/<job id>`` (relative to the working directory)."""
    return identity.run_dir or Path("warmstart-runs") / job_id


def quiet_errors(environ: Mapping[str, str] | None = None) -> bool:
    """:attr:`JobIdentity.quiet_errors` on its own. Never raises: it is what decides whether a
    process says that its settings are bad, :func:`job_identity`'s errors included."""
    env = os.environ if environ is None else environ
    return bool(env.get("WARMSTART_QUIET_ERRORS"))


def _env_int(env: Mapping[str, str], variable: str, default: int, minimum: int | None = None) -> int:
    raw = env.get(variable, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(variable, raw, "an integer") from None
    if minimum is not None and value < minimum:
        raise ConfigError(variable, raw, f"an integer >= {minimum}")
    return value


def _env_seconds(env: Mapping[str, str], variable: str, default: float, *, zero_ok: bool, accepted: str) -> float:
    """A finite number of seconds from ``variable`` (> 0, or >= 0 with ``zero_ok``); ``default`` when unset."""
    raw = env.get(variable, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(variable, raw, accepted) from None
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise ConfigError(variable, raw, accepted)
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class ServerSettings:
    """What ``warmstart server`` reads from the environment."""

    dir: Path
    """``WARMSTART_SERVER_DIR``, else ``$XDG_STATE_HOME/warmstart/server``, else ``~/.local/state/warmstart/server``."""
    redis_server: str | None
    """``WARMSTART_REDIS_SERVER``: the ``redis-server`` binary to run; ``None``: the one on ``PATH``."""
    redis_cli: str | None
    """``WARMSTART_REDIS_CLI``: the ``redis-cli`` binary; ``None``: next to redis-server, else on ``PATH``."""


def server_settings(environ: Mapping[str, str] | None = None) -> ServerSettings:
    """The server settings from ``environ`` (default ``os.environ``). Never raises: binaries are
    checked where they are looked up."""
    env = os.environ if environ is None else environ
    if env.get("WARMSTART_SERVER_DIR"):
        directory = Path(env["WARMSTART_SERVER_DIR"]).expanduser()
    else:
        base = env.get("XDG_STATE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".local", "state")
        directory = Path(base) / "warmstart" / "server"
    return ServerSettings(
        dir=directory,
        redis_server=env.get("WARMSTART_REDIS_SERVER", "").strip() or None,
        redis_cli=env.get("WARMSTART_REDIS_CLI", "").strip() or None,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class MetricsSettings:
    """Where a job's live metrics go (``warmstart.metrics.live``)."""

    port: int | None = None
    """``WARMSTART_METRICS_PORT``: serve them over HTTP on this port (plus the local rank when every
    rank exports); ``None`` (unset or 0): no endpoint."""
    textfile: Path | None = None
    """``WARMSTART_METRICS_TEXTFILE``: also write them to this ``.prom`` file (node_exporter's textfile
    collector); ``None``: no file."""
    all_ranks: bool = False
    """``WARMSTART_METRICS_RANKS=all``: every rank exports; else (``0``, unset) rank 0 alone."""
    interval_s: float = _defaults.METRICS_INTERVAL_S
    """``WARMSTART_METRICS_INTERVAL_S``: seconds between refreshes of the figures and the textfile."""
    local_rank: int = 0
    """``LOCAL_RANK`` (torchrun's rank on this machine), else 0."""

    @property
    def on(self) -> bool:
        """Whether any delivery is asked for."""
        return self.port is not None or self.textfile is not None


def metrics_settings(environ: Mapping[str, str] | None = None) -> MetricsSettings:
    """The live-metrics settings from ``environ`` (default ``os.environ``).

    Raises:
        ConfigError: a ``WARMSTART_METRICS_*`` variable or ``LOCAL_RANK`` holds a value that is not accepted.
    """
    env = os.environ if environ is None else environ
    port = _env_int(env, "WARMSTART_METRICS_PORT", 0, minimum=0)
    if port > 65535:
        raise ConfigError("WARMSTART_METRICS_PORT", env["WARMSTART_METRICS_PORT"], "a port from 1 to 65535, or 0 (off)")
    textfile_raw = env.get("WARMSTART_METRICS_TEXTFILE", "").strip()
    if textfile_raw and not textfile_raw.endswith(".prom"):  # node_exporter reads *.prom files only
        raise ConfigError("WARMSTART_METRICS_TEXTFILE", textfile_raw, "a file path ending in .prom")
    ranks = env.get("WARMSTART_METRICS_RANKS", "").strip().lower() or "0"
    if ranks not in ("0", "all"):
        raise ConfigError("WARMSTART_METRICS_RANKS", env["WARMSTART_METRICS_RANKS"], "0 (rank 0 only) or all")
    interval_s = _env_seconds(
        env,
        "WARMSTART_METRICS_INTERVAL_S",
        _defaults.METRICS_INTERVAL_S,
        zero_ok=False,
        accepted="seconds, a number greater than 0",
    )
    return MetricsSettings(
        port=port or None,
        textfile=Path(textfile_raw).expanduser() if textfile_raw else None,
        all_ranks=ranks == "all",
        interval_s=interval_s,
        local_rank=_env_int(env, "LOCAL_RANK", 0, minimum=0),
    )


#: ``warmstart.enable()``'s keyword arguments and the variables they set.
ENABLE_VARIABLES: dict[str, str] = {
    "cache_url": "WARMSTART_CACHE_URL",
    "cache_dir": "WARMSTART_CACHE_DIR",
    "cache_size": "WARMSTART_CACHE_SIZE",
    "mode": "WARMSTART_CACHE_MODE",
    "secret": "WARMSTART_SECRET",
    "secret_file": "WARMSTART_SECRET_FILE",
    "key_file": "WARMSTART_KEY_FILE",
    "namespace": "WARMSTART_NAMESPACE",
    "compile_wait_s": "WARMSTART_COMPILE_WAIT_S",
    "max_wait_s": "WARMSTART_MAX_WAIT_S",
    "dynamo": "WARMSTART_DYNAMO",
    "run_dir": "WARMSTART_RUN_DIR",
    "job_id": "WARMSTART_JOB_ID",
}


def enable_environment(environ: Mapping[str, str], **given: object) -> dict[str, str]:
    """``environ`` plus ``WARMSTART=1`` and the variables for ``warmstart.enable()``'s arguments
    (``None`` values left out), checked: the environment a job gets from ``enable(**given)``.

    Raises:
        ConfigError: a setting is malformed.
    """
    env = dict(environ)
    env["WARMSTART"] = "1"
    env.update({ENABLE_VARIABLES[name]: str(value) for name, value in given.items() if value is not None})
    Settings.from_env(env)  # the job identity too
    return env


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """Everything warmstart reads from the environment, parsed and checked."""

    enabled: bool = False
    """``WARMSTART=1``: turn the toolkit on in this process and its children."""
    cache_url: str | None = None
    """``WARMSTART_CACHE_URL``: the remote tier; ``None`` means local only."""
    cache_dir: Path = dataclasses.field(default_factory=lambda: _default_cache_dir(os.environ))
    """``WARMSTART_CACHE_DIR``: the local (diskcache) tier."""
    cache_dir_shared: bool = False
    """``WARMSTART_CACHE_DIR_SHARED=1``: the local directory is shared on purpose, so use it even when
    another user owns it or group or others can write it. Whoever can write it runs code in this job:
    without this, such a directory is refused (one warning, local tier off)."""
    cache_size: int = _defaults.CACHE_SIZE_BYTES
    """``WARMSTART_CACHE_SIZE`` in bytes; least recently used entries are evicted past it."""
    mode: str = _defaults.CACHE_MODE
    """``WARMSTART_CACHE_MODE``: ``rw``, ``ro`` (never write) or ``off``."""
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    """``WARMSTART_SECRET`` / ``WARMSTART_SECRET_FILE``: HMAC key for remote entries (every holder can
    sign). Ignored when ``key_file`` is set."""
    key_file: Path | None = None
    """``WARMSTART_KEY_FILE``: PEM Ed25519 key for remote entries: the private key (``signing.key``)
    signs and verifies, the public key (``verify.pub``) only verifies, and a job holding only it never
    writes to the remote tier. When both this and ``WARMSTART_SECRET[_FILE]`` are set, the key file
    wins: the job signs and verifies with it alone."""
    namespace: str = ""
    """``WARMSTART_NAMESPACE``: extra namespace (team, trust domain)."""
    compile_wait_s: float = _defaults.COMPILE_WAIT_S
    """``WARMSTART_COMPILE_WAIT_S``: the longest a process waits for another process that is compiling
    the entry it missed (then it compiles it itself); 0 turns single-flight compiles off."""
    max_wait_s: float = _defaults.MAX_WAIT_S
    """``WARMSTART_MAX_WAIT_S``: the most seconds this process spends waiting on the cache in total
    (tiers, peers' leases, the exit flush); past it, it waits no more (see ``wait_budget.py``)."""
    fetch_ahead: bool = True
    """``WARMSTART_FETCH_AHEAD``: ``1`` (default) fetches the remote entries this program looked up
    last time in one exchange when it starts compiling (see ``compile_cache/fetch_ahead.py``); ``0``
    looks each one up when it is needed."""
    dynamo_frames: bool = False
    """``WARMSTART_DYNAMO``: ``1`` shares Dynamo's output (each compiled frame's bytecode and guards),
    so a new machine does not trace frames another one compiled; off by default."""
    compile_mode: str = "inline"
    """``WARMSTART_COMPILE``: ``inline`` or ``background`` (see ``compile_cache/background.py``)."""
    job: JobIdentity = dataclasses.field(default_factory=lambda: JobIdentity(False, "", None, 0, 0, False))
    """Which job, rank and attempt this process belongs to (see :func:`job_identity`)."""

    @property
    def fetches_ahead(self) -> bool:
        """Whether a process with these settings fetches its remote entries ahead: on, with a
        remote tier (see ``compile_cache/fetch_ahead.py``)."""
        return self.enabled and self.fetch_ahead and self.cache_url is not None and self.mode != "off"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Build settings from ``environ`` (default ``os.environ``); keyword overrides win.

        Raises:
            ConfigError: a variable holds a value that is not accepted.
        """
        env = os.environ if environ is None else environ
        enabled_raw = env.get("WARMSTART", "")
        if enabled_raw not in ("", "0", "1"):
            raise ConfigError("WARMSTART", enabled_raw, "1 (on), 0 or unset (off)")
        preload_raw = env.get("WARMSTART_PRELOAD", "")
        if preload_raw not in ("", "0", "1"):
            expected = "0 (never hand a process over to a preloader), 1 or unset (do when one serves)"
            raise ConfigError("WARMSTART_PRELOAD", preload_raw, expected)
        mode = env.get("WARMSTART_CACHE_MODE", _defaults.CACHE_MODE).strip().lower() or _defaults.CACHE_MODE
        if mode not in MODES:
            raise ConfigError("WARMSTART_CACHE_MODE", env["WARMSTART_CACHE_MODE"], "one of rw, ro, off")
        url = env.get("WARMSTART_CACHE_URL", "").strip() or None
        if url is not None:
            validate_cache_url(url)
        size_raw = env.get("WARMSTART_CACHE_SIZE", "").strip()
        cache_size = parse_size(size_raw) if size_raw else _defaults.CACHE_SIZE_BYTES
        cache_dir = (
            Path(env["WARMSTART_CACHE_DIR"]).expanduser() if env.get("WARMSTART_CACHE_DIR") else _default_cache_dir(env)
        )
        shared_raw = env.get("WARMSTART_CACHE_DIR_SHARED", "")
        if shared_raw not in ("", "0", "1"):
            raise ConfigError("WARMSTART_CACHE_DIR_SHARED", shared_raw, "1 (shared on purpose), 0 or unset (private)")
        secret = _read_secret(env)
        key_file = _check_key_file(env)
        namespace = env.get("WARMSTART_NAMESPACE", "").strip()
        if namespace and not re.fullmatch(r"[A-Za-z0-9._\-]+", namespace):
            raise ConfigError("WARMSTART_NAMESPACE", namespace, "letters, digits, '.', '_' and '-'")
        compile_wait_s = _env_seconds(
            env,
            "WARMSTART_COMPILE_WAIT_S",
            _defaults.COMPILE_WAIT_S,
            zero_ok=True,
            accepted="seconds, a number >= 0 (0 turns waiting off)",
        )
        max_wait_s = _env_seconds(
            env,
            "WARMSTART_MAX_WAIT_S",
            _defaults.MAX_WAIT_S,
            zero_ok=True,
            accepted="seconds, a number >= 0 (0: never wait on the cache)",
        )
        fetch_ahead_raw = env.get("WARMSTART_FETCH_AHEAD", "").strip()
        if fetch_ahead_raw not in ("", "0", "1"):
            raise ConfigError("WARMSTART_FETCH_AHEAD", fetch_ahead_raw, "1 or unset (fetch ahead), 0 (off)")
        dynamo_frames = dynamo_frames_setting(env)
        compile_mode = compile_mode_setting(env)
        job = job_identity(env)
        values: dict[str, object] = dict(
            enabled=enabled_raw == "1",
            cache_url=url,
            cache_dir=cache_dir,
            cache_dir_shared=shared_raw == "1",
            cache_size=cache_size,
            mode=mode,
            secret=secret,
            key_file=key_file,
            namespace=namespace,
            compile_wait_s=compile_wait_s,
            job=job,
            max_wait_s=max_wait_s,
            # A background compile's worker serves many programs under one name: no manifest of its own;
            # the preloader never compiles, and forks: no thread of its own either.
            fetch_ahead=fetch_ahead_raw != "0"
            and env.get("WARMSTART_COMPILE_WORKER") != "1"
            and not env.get("WARMSTART_PRELOAD_SERVE"),
            dynamo_frames=dynamo_frames,
            compile_mode=compile_mode,
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def compile_mode_setting(env: Mapping[str, str] | None = None) -> str:
    """``WARMSTART_COMPILE``: ``inline`` (torch's own way, the default) or ``background`` (run eagerly
    until a compile worker has filled the cache, then switch); always ``inline`` in a compile worker.

    Raises:
        ConfigError: another value.
    """
    env = os.environ if env is None else env
    if env.get("WARMSTART_COMPILE_WORKER") == "1":
        return "inline"
    raw = env.get("WARMSTART_COMPILE", "").strip().lower() or "inline"
    if raw not in ("inline", "background"):
        raise ConfigError("WARMSTART_COMPILE", env["WARMSTART_COMPILE"], "inline or background")
    return raw


def dynamo_frames_setting(env: Mapping[str, str] | None = None) -> bool:
    """``WARMSTART_DYNAMO``: whether Dynamo's output is shared (``1``; off by default), read on its own
    for the hook that needs only it (``Settings.from_env`` also checks the key file and the URL).

    Raises:
        ConfigError: a value other than ``1``, ``0`` or empty.
    """
    env = os.environ if env is None else env
    raw = env.get("WARMSTART_DYNAMO", "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError("WARMSTART_DYNAMO", env["WARMSTART_DYNAMO"], "1 (on), 0 or unset (off)")
    return raw == "1"


def dynamo_frames_given(environ: Mapping[str, str] | None = None) -> str | None:
    """``WARMSTART_DYNAMO`` as given, ``None`` where unset: passed on as it is to a job's processes,
    which check it themselves (:func:`dynamo_frames_setting`)."""
    env = os.environ if environ is None else environ
    return env.get("WARMSTART_DYNAMO")


def warmstart_on(environ: Mapping[str, str] | None = None) -> bool:
    """``WARMSTART=1``: warmstart runs in a process started with ``environ`` (default this one's)."""
    env = os.environ if environ is None else environ
    return env.get("WARMSTART") == "1"


def compile_worker_job(environ: Mapping[str, str] | None = None) -> str:
    """``WARMSTART_COMPILE_WORKER_JOB``: ``<pid>:<start time>`` of the job a background compile's
    worker was started for (set by the job; a worker ends with it).

    Raises:
        KeyError: unset, in a process no job started as its worker.
    """
    env = os.environ if environ is None else environ
    return env["WARMSTART_COMPILE_WORKER_JOB"]


# -- the preloader (warmstart/preload/); its hand-over in the start-up hook reads its own few, with
# built-in modules only (preload/client.py, preload/environment.py)


def preload_setting(environ: Mapping[str, str] | None = None) -> str:
    """``WARMSTART_PRELOAD`` as given (empty where unset): ``1`` or empty hands a process over."""
    env = os.environ if environ is None else environ
    return env.get("WARMSTART_PRELOAD", "")


def preload_socket(environ: Mapping[str, str] | None = None) -> str | None:
    """``WARMSTART_PRELOAD_SOCKET``: the preloader's socket chosen by the user, ``None`` where unset
    or empty (a path per user and environment then)."""
    env = os.environ if environ is None else environ
    return env.get("WARMSTART_PRELOAD_SOCKET") or None


def preload_modules(environ: Mapping[str, str] | None = None) -> list[str]:
    """``WARMSTART_PRELOAD_MODULES``: comma-separated modules a preloader imports besides its own."""
    env = os.environ if environ is None else environ
    return [m.strip() for m in env.get("WARMSTART_PRELOAD_MODULES", "").split(",") if m.strip()]


def take_preload_ready_fd(environ: MutableMapping[str, str] | None = None) -> int | None:
    """``WARMSTART_PRELOAD_READY_FD``, removed from ``environ`` (default this process's, so that no
    child inherits it): the descriptor a starting preloader says it serves on; ``None`` where unset."""
    env = os.environ if environ is None else environ
    fd = env.pop("WARMSTART_PRELOAD_READY_FD", None)
    return None if fd is None else int(fd)


# -- torch's own variables, read where warmstart decides whether to set torch's switches


def torch_pgo_key_given(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the user named torch's PGO state (``TORCH_COMPILE_JOB_ID`` or
    ``TORCH_COMPILE_STICKY_PGO_KEY``): warmstart then leaves it as it is."""
    env = os.environ if environ is None else environ
    return bool(env.get("TORCH_COMPILE_JOB_ID") or env.get("TORCH_COMPILE_STICKY_PGO_KEY"))


def torch_compile_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """``TORCH_COMPILE_JOB_ID``, ``None`` where unset or empty."""
    env = os.environ if environ is None else environ
    return env.get("TORCH_COMPILE_JOB_ID") or None


def torch_variable_set(variable: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether torch's environment variable ``variable`` (one of the switches ``torch_hooks`` turns
    on) is set, so that its value is the user's and not warmstart's."""
    env = os.environ if environ is None else environ
    return variable in env


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


def _check_key_file(env: Mapping[str, str]) -> Path | None:
    """The ``WARMSTART_KEY_FILE`` path, once it is known to be a readable PEM key file.

    Only the file's shape is checked here (no ``cryptography`` import at settings time);
    ``signing.load_key_file`` parses it when the store is built and raises the same kind of error.
    """
    raw = env.get("WARMSTART_KEY_FILE", "").strip()
    if not raw:
        return None
    path = Path(raw).expanduser()
    accepted = "a PEM file holding an Ed25519 private key (signing.key) or public key (verify.pub)"
    try:
        data = path.read_bytes()[:65536]
    except OSError as exc:
        raise ConfigError(
            "WARMSTART_KEY_FILE", raw, f"{accepted}; it cannot be read ({exc.strerror or type(exc).__name__})"
        ) from None
    if not re.search(rb"-----BEGIN (PRIVATE|PUBLIC) KEY-----", data):
        raise ConfigError("WARMSTART_KEY_FILE", raw, accepted)
    return path


def new_job_id() -> str:
    """A fresh job id for a job whose launcher gave none."""
    return "job-" + uuid.uuid4().hex[:12]
