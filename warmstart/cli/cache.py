"""``warmstart cache stats|doctor|clear``: the compile cache seen from the command line."""

from __future__ import annotations

import os
import time
import uuid

import click

from warmstart.cli._output import emit_json, json_option, print_table


@click.group()
def group() -> None:
    """Inspect, check and empty the compile cache.

    \b
    Example:
      WARMSTART_CACHE_URL=redis://cache:6379/0 warmstart cache doctor
    """


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@group.command()
@json_option
def stats(as_json: bool) -> None:
    """Hits, misses, errors, bytes and seconds saved, per tier and artifact kind.

    Counts are summed over every process that used this cache directory (WARMSTART_CACHE_DIR).

    \b
    Example:
      warmstart cache stats --json
    """
    from warmstart.compile_cache import KINDS, stats_path
    from warmstart.compile_cache import stats as stats_mod
    from warmstart.config import Settings

    settings = Settings.from_env()
    counts = stats_mod.load(stats_path(settings))
    local = _local_usage(settings)
    tiers = counts.to_dict()
    totals = {}
    for tier in tiers:
        total = stats_mod.Counts()
        for (t, _kind), c in counts.items():
            if t == tier:
                total = total + c
        totals[tier] = total.to_dict()
    if as_json:
        emit_json({"cache_dir": str(settings.cache_dir), "local": local, "tiers": tiers, "totals": totals,
                   "counters": counts.counters_dict()})
        return
    rows = []
    for (tier, kind), c in counts.items():
        lookups = c.hits + c.misses
        rows.append([tier, KINDS.get(kind, kind), c.hits, c.misses,
                     f"{100 * c.hits / lookups:.0f}%" if lookups else "-", c.errors + c.timeouts, c.rejected,
                     _human_bytes(c.bytes_read), _human_bytes(c.bytes_written), f"{c.saved_s:.1f}"])
    if not rows:
        click.echo(f"No cache activity recorded in {settings.cache_dir} yet.")
    else:
        print_table(f"warmstart cache ({settings.cache_dir})",
                    ["tier", "kind", "hits", "misses", "hit rate", "errors", "rejected", "read", "written",
                     "saved s"], rows)
    click.echo(f"local tier: {local['entries']} entries, {_human_bytes(local['bytes'])} of "
               f"{_human_bytes(local['limit'])}")
    if counts.counters_dict().get("recompiles"):
        click.echo(f"recompilations: {counts.counters_dict()['recompiles']}")


def _local_usage(settings) -> dict[str, int]:
    from warmstart.compile_cache import LocalTier

    if not (settings.cache_dir / "store").exists():
        return {"entries": 0, "bytes": 0, "limit": settings.cache_size}
    tier = LocalTier(settings.cache_dir, settings.cache_size)
    try:
        return {"entries": len(tier), "bytes": tier.volume(), "limit": settings.cache_size}
    finally:
        tier.close()


@group.command()
@click.option("--local", "local_", is_flag=True, help="Empty the local tier (the default).")
@click.option("--remote", is_flag=True, help="Empty this namespace on the remote tier (other namespaces stay).")
def clear(local_: bool, remote: bool) -> None:
    """Empty a tier. With no flag, the local tier only.

    \b
    Example:
      warmstart cache clear --local --remote
    """
    from warmstart.compile_cache import LocalTier, RemoteTier, stats_path
    from warmstart.compile_cache.namespace import namespace
    from warmstart.config import Settings

    settings = Settings.from_env()
    if not remote:
        local_ = True
    if local_:
        tier = LocalTier(settings.cache_dir, settings.cache_size)
        removed = tier.clear()
        tier.close()
        stats_path(settings).unlink(missing_ok=True)
        click.echo(f"local: removed {removed} entries from {settings.cache_dir}")
    if remote:
        if not settings.cache_url:
            raise click.UsageError("--remote needs WARMSTART_CACHE_URL")
        ns = namespace(settings.namespace)
        tier = RemoteTier(settings.cache_url, secret=settings.secret or b"-", namespace=ns)
        try:
            removed = tier.clear()
        except Exception as exc:
            raise click.ClickException(f"remote: could not clear namespace {ns}: {exc}") from None
        click.echo(f"remote: removed {removed} keys of namespace {ns}")


@group.command()
def doctor() -> None:
    """Check the configuration end to end and say what is wrong in plain words.

    Checks settings, the local directory, the server URL, authentication, the secret, the
    namespace, a write/read round trip and latency, and whether the server holds entries signed
    with other secrets (which this job never reads). Also warns when TMPDIR is too long for
    DataLoader workers' sockets (AF_UNIX paths: 107 bytes). Exit code 1 if any check fails.

    \b
    Example:
      WARMSTART=1 WARMSTART_CACHE_URL=redis://writer:pw@cache:6379/0 \\
      WARMSTART_SECRET_FILE=/etc/warmstart/secret warmstart cache doctor
    """
    from warmstart.config import Settings
    from warmstart.errors import ConfigError

    checks: list[tuple[str, bool | None, str]] = []  # (what, ok / None = warning, detail)

    def check(what: str, ok: bool | None, detail: str) -> None:
        checks.append((what, ok, detail))

    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        check("settings", False, str(exc))
        _print_checks(checks)
        raise SystemExit(1)
    check("settings", True, f"mode {settings.mode}, local dir {settings.cache_dir}")
    check("enabled", True if settings.enabled else None,
          "WARMSTART=1" if settings.enabled else "WARMSTART is not 1: jobs will not use the cache")
    _check_local(settings, check)
    _check_remote(settings, check)
    _check_tmpdir(check)
    _print_checks(checks)
    if any(ok is False for _, ok, _ in checks):
        raise SystemExit(1)


def _check_tmpdir(check) -> None:
    # DataLoader workers' AF_UNIX sockets live under TMPDIR: warn when they would not fit
    from warmstart.compile_cache.doctor_checks import tmpdir_check

    ok, detail = tmpdir_check()
    check("TMPDIR", ok, detail)


def _check_local(settings, check) -> None:
    from warmstart.compile_cache import LocalTier
    from warmstart.compile_cache.local import UnsafeCacheDir, check_private

    try:
        if not settings.cache_dir_shared:
            check_private(settings.cache_dir)
        tier = LocalTier(settings.cache_dir, settings.cache_size)
        probe = uuid.uuid4().hex
        ok = tier.put("doctor", probe, b"ok") and tier.get("doctor", probe) == b"ok"
        tier._cache.delete(f"doctor:{probe}")
        tier.close()
        check("local tier", ok, f"{settings.cache_dir} is writable, limit {_human_bytes(settings.cache_size)}"
              if ok else f"{settings.cache_dir}: write/read round trip failed")
    except UnsafeCacheDir as exc:
        check("local tier", False, f"{exc}: jobs refuse it (chmod 700 it, or set WARMSTART_CACHE_DIR_SHARED=1 if it "
              "is shared on purpose)")
    except Exception as exc:
        check("local tier", False, f"{settings.cache_dir}: {exc}")


def _check_remote(settings, check) -> None:
    import redis

    from warmstart.compile_cache import RemoteTier, signing
    from warmstart.compile_cache.namespace import components, namespace
    from warmstart.config import redact_url
    from warmstart.errors import ConfigError

    if not settings.cache_url:
        check("remote tier", None, "WARMSTART_CACHE_URL is not set: local tier only")
        return

    try:
        keys = signing.keys_for(settings.key_file, settings.secret)
    except ConfigError as exc:
        check("signing key", False, str(exc))
        return
    if keys is None:
        check("signing key", False, "no WARMSTART_KEY_FILE, WARMSTART_SECRET or WARMSTART_SECRET_FILE: jobs will "
              "refuse the remote tier")
        return
    if keys.scheme == "ed25519":
        role = "private key: signs and verifies" if keys.can_sign else "public key: verifies only, never writes"
        check("signing key", True, f"Ed25519 {role} (key id {keys.key_id})")
    else:
        check("signing key", True, f"{len(settings.secret)}-byte HMAC secret (key id {keys.key_id}); every holder can sign: "
              "prefer WARMSTART_KEY_FILE (Ed25519) for shared caches")
    ns = namespace(settings.namespace)
    parts = components(settings.namespace)
    check("namespace", True, f"{ns} (torch {parts['torch']}, {parts['python_abi']}, {parts['gpu_arch']}, "
          f"cpu {parts['cpu_isa'].split(':')[0]})")
    tier = RemoteTier(settings.cache_url, keys=keys, namespace=ns)
    redacted = redact_url(settings.cache_url)
    try:
        start = time.perf_counter()
        tier.ping()
        latency_ms = (time.perf_counter() - start) * 1000
    except redis.exceptions.AuthenticationError as exc:
        check("server", False, f"{redacted}: authentication failed ({exc}); check the user and password in the URL")
        return
    except redis.exceptions.ResponseError as exc:
        check("server", False, f"{redacted}: {exc}")
        return
    except Exception as exc:
        check("server", False, f"{redacted}: cannot connect ({type(exc).__name__}: {exc})")
        return
    check("server", True, f"{redacted} answers in {latency_ms:.1f} ms")
    probe = f"doctor-{uuid.uuid4().hex}"
    if settings.mode == "rw" and keys.can_sign:
        if not tier.put("doctor", probe, os.urandom(4096)):
            check("write", False, "the server refused a write: read-only credentials? use WARMSTART_CACHE_MODE=ro "
                  "for readers, or the writer URL")
        else:
            start = time.perf_counter()
            ok = tier.get("doctor", probe) is not None
            tier.delete("doctor", probe)
            check("round trip", ok, f"wrote and read back a signed entry in {(time.perf_counter() - start) * 1000:.1f} ms"
                  if ok else "wrote an entry but could not read it back")
    else:
        tier.get("doctor", probe)
        c = tier.stats.get("remote", "doctor")
        check("read", c.errors == 0, "reads work (read-only mode: no write attempted)" if c.errors == 0
              else "reads fail: does this user have read permission?")
    _check_key_ids(tier, check)
    tier.close()


def _check_key_ids(tier, check) -> None:
    try:
        counts = tier.key_ids()
    except Exception as exc:  # a reader without SCAN rights on a hardened server: skip the check
        check("secret in use", None, f"could not list entries ({type(exc).__name__})")
        return
    ours, others = counts.pop(tier.key_id, 0), counts
    if others:
        names = ", ".join(f"{kid} ({n})" for kid, n in sorted(others.items(), key=lambda kv: -kv[1])[:3])
        check("secret in use", None,
              f"{ours} entries under this secret's key id {tier.key_id}; {sum(others.values())} under other "
              f"secrets: {names}. Jobs never read entries signed with another secret: give every job of "
              f"the team the same WARMSTART_SECRET_FILE (old key ids fade out by LRU after a rotation)")
    else:
        check("secret in use", True, f"{ours} entries under this secret's key id {tier.key_id}")


def _print_checks(checks) -> None:
    from rich.console import Console

    console = Console(soft_wrap=True)
    for what, ok, detail in checks:
        mark = "[green]  ok[/]" if ok else ("[yellow]warn[/]" if ok is None else "[red]FAIL[/]")
        console.print(f"{mark}  [bold]{what}[/]: {detail}", highlight=False)
