"""``warmstart cache doctor`` as data: the compile cache's configuration checked end to end.

:func:`diagnose` reads the settings, then checks the local directory, the server URL,
authentication, the signing key, the namespace, a write/read round trip and its latency, the key
ids the server's entries are signed with, and the job's ``TMPDIR``. It prints nothing: it returns a
:class:`Diagnosis` (each check with an ``ok``/``warn``/``fail`` status and a detail in plain words,
plus the namespace and key ids it found), which ``warmstart cache doctor`` renders. The probes it
writes are removed again.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

OK = "ok"
"""The check passed."""
WARN = "warn"
"""Jobs run, but not as intended (the cache is off, entries are out of reach)."""
FAIL = "fail"
"""Jobs lose a tier, or the cache altogether."""
STATUSES = (OK, WARN, FAIL)

SETTINGS = "settings"
"""Name of the first check: when it fails the environment is malformed and nothing else is checked."""

_PROBE_KIND = "doctor"


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the diagnosis."""

    name: str
    status: str
    """One of :data:`STATUSES`."""
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


@dataclasses.dataclass
class Diagnosis:
    """Every check in the order it ran, and what the doctor found on the way."""

    checks: list[Check] = dataclasses.field(default_factory=list)
    namespace: str | None = None
    """The namespace id remote entries live under; ``None`` without a remote tier to check."""
    components: dict[str, str] = dataclasses.field(default_factory=dict)
    """What the namespace is made of (torch, Python ABI, CPU ISA, GPU arch, ...); empty with no namespace."""
    key_id: str | None = None
    """Key id of the signing key or secret in use; ``None`` without one."""
    key_id_entries: int | None = None
    """Entries on the server under :attr:`key_id`; ``None`` when not counted."""
    other_key_ids: dict[str, int] | None = None
    """Entries on the server per other key id (jobs never read them); ``None`` when not counted."""

    @property
    def ok(self) -> bool:
        """No check failed (warnings allowed)."""
        return all(c.status != FAIL for c in self.checks)

    @property
    def settings_valid(self) -> bool:
        """The environment could be read (a malformed variable fails :data:`SETTINGS` and stops the checks)."""
        return not any(c.name == SETTINGS and c.status == FAIL for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """The ``warmstart cache doctor --json`` object (keys documented on the command)."""
        return {
            "ok": self.ok,
            "checks": [c.to_dict() for c in self.checks],
            "namespace": {"id": self.namespace, "components": dict(self.components)} if self.namespace else None,
            "key_id": self.key_id,
            "key_id_entries": self.key_id_entries,
            "other_key_ids": self.other_key_ids,
        }

    def _add(self, name: str, status: str, detail: str) -> None:
        self.checks.append(Check(name, status, detail))


def diagnose(environ: Mapping[str, str] | None = None) -> Diagnosis:
    """Check the cache configuration ``environ`` describes (the process environment when omitted).

    Never raises for a configuration problem: each one is a failed or warning check.
    """
    from warmstart.config import Settings
    from warmstart.errors import ConfigError

    diagnosis = Diagnosis()
    try:
        settings = Settings.from_env(environ)
    except ConfigError as exc:
        diagnosis._add(SETTINGS, FAIL, str(exc))
        return diagnosis
    diagnosis._add(SETTINGS, OK, f"mode {settings.mode}, local dir {settings.cache_dir}")
    diagnosis._add(
        "enabled",
        OK if settings.enabled else WARN,
        "WARMSTART=1" if settings.enabled else "WARMSTART is not 1: jobs will not use the cache",
    )
    _check_torch(settings, diagnosis)
    _check_local(settings, diagnosis)
    _check_remote(settings, diagnosis)
    _check_tmpdir(environ, diagnosis)
    _check_preload(environ, diagnosis)
    return diagnosis


def _check_torch(settings, diagnosis: Diagnosis) -> None:
    # The installed torch's version, from its metadata: the doctor does not import torch.
    from warmstart import torch_support

    version = torch_support.torch_version()
    if version is None:
        diagnosis._add("torch", WARN, "torch is not installed in this environment: jobs here cannot compile")
    elif not torch_support.is_checked(version):
        diagnosis._add("torch", WARN, torch_support.unchecked_warning(version).removeprefix("warmstart: "))
    elif torch_support.frames_checked(version):
        diagnosis._add("torch", OK, f"torch {version}: a version warmstart was checked against, every hook in use")
    else:
        frames = torch_support.frames_off_warning(version).removeprefix("warmstart: ")
        diagnosis._add(
            "torch",
            WARN if settings.dynamo_frames else OK,
            f"torch {version}: a version warmstart was checked against; {frames}",
        )


def _check_preload(environ: Mapping[str, str] | None, diagnosis: Diagnosis) -> None:
    # Whether a `python` started here would fork from a preloader: a start without one is not a
    # fault (ok either way), but the reason is what a user asks the doctor for.
    from warmstart.preload.control import would_hand_over

    try:
        served, why = would_hand_over(None if environ is None else dict(environ))
    except Exception as exc:  # the doctor reports, it never fails on a check of its own
        served, why = False, f"could not tell ({type(exc).__name__}: {exc})"
    diagnosis._add("preloader", OK, ("handed over: " if served else "not handed over: ") + why)


def _check_local(settings, diagnosis: Diagnosis) -> None:
    from warmstart.compile_cache.local import LocalTier, UnsafeCacheDir, check_private

    try:
        if not settings.cache_dir_shared:
            check_private(settings.cache_dir)
        tier = LocalTier(settings.cache_dir, settings.cache_size)
        try:
            probe = uuid.uuid4().hex
            ok = tier.put(_PROBE_KIND, probe, b"ok") and tier.get(_PROBE_KIND, probe).value == b"ok"
            tier.delete(_PROBE_KIND, probe)
        finally:
            tier.close()
    except UnsafeCacheDir as exc:
        diagnosis._add(
            "local tier",
            FAIL,
            f"{exc}: jobs refuse it (chmod 700 it, or set WARMSTART_CACHE_DIR_SHARED=1 if it is shared on purpose)",
        )
        return
    except Exception as exc:  # a damaged database, a file in the way, no permission, a full disk
        diagnosis._add("local tier", FAIL, f"{settings.cache_dir}: {exc}")
        return
    if ok:
        diagnosis._add(
            "local tier", OK, f"{settings.cache_dir} is writable, limit {settings.cache_size / 1024**3:.1f} GiB"
        )
    else:
        diagnosis._add("local tier", FAIL, f"{settings.cache_dir}: write/read round trip failed")


def _check_remote(settings, diagnosis: Diagnosis) -> None:
    from warmstart.compile_cache import signing
    from warmstart.compile_cache.namespace import components, namespace
    from warmstart.errors import ConfigError

    if not settings.cache_url:
        diagnosis._add("remote tier", WARN, "WARMSTART_CACHE_URL is not set: local tier only")
        return
    try:
        keys = signing.keys_for(settings.key_file, settings.secret)
    except ConfigError as exc:
        diagnosis._add("signing key", FAIL, str(exc))
        return
    if keys is None:
        diagnosis._add(
            "signing key",
            FAIL,
            "no WARMSTART_KEY_FILE, WARMSTART_SECRET or WARMSTART_SECRET_FILE: jobs will refuse the remote tier",
        )
        return
    diagnosis.key_id = keys.key_id
    if keys.scheme == "ed25519":
        role = "private key: signs and verifies" if keys.can_sign else "public key: verifies only, never writes"
        diagnosis._add("signing key", OK, f"Ed25519 {role} (key id {keys.key_id})")
    else:
        diagnosis._add(
            "signing key",
            OK,
            f"{len(settings.secret)}-byte HMAC secret (key id {keys.key_id}); every "
            "holder can sign: prefer WARMSTART_KEY_FILE (Ed25519) for shared caches",
        )
    ns = namespace(settings.namespace)
    diagnosis.namespace, diagnosis.components = ns, dict(components(settings.namespace))
    parts = diagnosis.components
    diagnosis._add(
        "namespace",
        OK,
        f"{diagnosis.namespace} (torch {parts['torch']}, {parts['python_abi']}, "
        f"{parts['gpu_arch']}, cpu {parts['cpu_isa'].split(':')[0]})",
    )
    tier = _connect(settings, keys, ns, diagnosis)
    if tier is None:
        return
    try:
        _check_round_trip(settings, tier, diagnosis)
        _check_key_ids(tier, diagnosis, keys.scheme)
    finally:
        tier.close()


def _connect(settings, keys, ns: str, diagnosis: Diagnosis):
    """The remote tier once its server answers (the ``server`` check), else ``None``."""
    import redis

    from warmstart.compile_cache.remote import RemoteTier
    from warmstart.config import redact_url

    redacted = redact_url(settings.cache_url)
    tier = None
    try:
        tier = RemoteTier(settings.cache_url, keys=keys, namespace=ns)
        start = time.perf_counter()
        tier.ping()
        latency_ms = (time.perf_counter() - start) * 1000
    except redis.exceptions.AuthenticationError as exc:
        detail = f"{redacted}: authentication failed ({exc}); check the user and password in the URL"
    except redis.exceptions.ResponseError as exc:
        detail = f"{redacted}: {exc}"
    except Exception as exc:
        detail = f"{redacted}: cannot connect ({type(exc).__name__}: {exc})"
    else:
        diagnosis._add("server", OK, f"{redacted} answers in {latency_ms:.1f} ms")
        return tier
    if tier is not None:
        tier.close()
    diagnosis._add("server", FAIL, detail)
    return None


def _check_round_trip(settings, tier, diagnosis: Diagnosis) -> None:
    probe = f"doctor-{uuid.uuid4().hex}"
    if settings.mode != "rw" or not tier.keys.can_sign:
        tier.get(_PROBE_KIND, probe)
        # A read that fails is a miss like any other: only the tier's error count tells them apart.
        errors = tier.stats.get("remote", _PROBE_KIND).errors
        diagnosis._add(
            "read",
            OK if errors == 0 else FAIL,
            "reads work (read-only mode: no write attempted)"
            if errors == 0
            else "reads fail: does this user have read permission?",
        )
        return
    if not tier.put(_PROBE_KIND, probe, os.urandom(4096)):
        diagnosis._add(
            "write",
            FAIL,
            "the server refused a write: read-only credentials? use "
            "WARMSTART_CACHE_MODE=ro for readers, or the writer URL",
        )
        return
    start = time.perf_counter()
    ok = tier.get(_PROBE_KIND, probe).value is not None
    elapsed_ms = (time.perf_counter() - start) * 1000
    tier.delete(_PROBE_KIND, probe)
    diagnosis._add(
        "round trip",
        OK if ok else FAIL,
        f"wrote and read back a signed entry in {elapsed_ms:.1f} ms"
        if ok
        else "wrote an entry but could not read it back",
    )


def _check_key_ids(tier, diagnosis: Diagnosis, scheme: str) -> None:
    # Worded for what the job holds: an Ed25519 key pair (WARMSTART_KEY_FILE) or a shared secret.
    if scheme == "ed25519":
        check, held, others = "key in use", "this key", "other keys"
        advice = (
            "give every job of the team the keys of the same server: its signing.key to jobs that fill "
            "the cache, its verify.pub to the others (WARMSTART_KEY_FILE)"
        )
    else:
        check, held, others = "secret in use", "this secret", "other secrets"
        advice = "give every job of the team the same WARMSTART_SECRET_FILE"
    try:
        counts = tier.key_ids()
    except Exception as exc:
        if type(exc).__name__ == "NoPermissionError":  # the reader role, as warmstart server sets it up
            diagnosis._add(
                check,
                OK,
                "not counted: this URL's user (a reader) may read entries but "
                "not list them; the writer URL counts the entries under each key id",
            )
        else:
            diagnosis._add(check, WARN, f"could not list entries ({type(exc).__name__}: {exc})")
        return
    ours = counts.pop(tier.key_id, 0)
    diagnosis.key_id_entries, diagnosis.other_key_ids = ours, counts
    if not counts:
        diagnosis._add(check, OK, f"{ours} entries under {held}'s key id {tier.key_id}")
        return
    names = ", ".join(f"{kid} ({n})" for kid, n in sorted(counts.items(), key=lambda kv: -kv[1])[:3])
    diagnosis._add(
        check,
        WARN,
        f"{ours} entries under {held}'s key id {tier.key_id}; {sum(counts.values())} under {others}: "
        f"{names}. Jobs never read entries signed with another key: {advice} (old key ids fade out by "
        "LRU after a rotation)",
    )


def _check_tmpdir(environ: Mapping[str, str] | None, diagnosis: Diagnosis) -> None:
    # DataLoader workers' AF_UNIX sockets live under TMPDIR: a path too long for them hangs the job
    from warmstart.compile_cache.doctor_checks import tmpdir_check

    fits, detail = tmpdir_check(environ)
    diagnosis._add("TMPDIR", OK if fits else WARN, detail)
