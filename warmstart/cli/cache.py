"""``warmstart cache stats|doctor|explain|clear``: the compile cache seen from the command line."""

from __future__ import annotations

import collections
from pathlib import Path

import click

from warmstart.cli._output import emit_json, json_option, print_lines, print_table, terminal_console


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
        totals[tier] = {**total.to_dict(), "saved_wall_s": stats_mod.wall_saved_estimate(counts, tier)}
    if as_json:
        emit_json(
            {
                "cache_dir": str(settings.cache_dir),
                "local": local,
                "tiers": tiers,
                "totals": totals,
                "counters": counts.counters_dict(),
            }
        )
        return
    rows = []
    for (tier, kind), c in counts.items():
        lookups = c.hits + c.misses
        rows.append(
            [
                tier,
                KINDS.get(kind, kind),
                c.hits,
                c.misses,
                f"{100 * c.hits / lookups:.0f}%" if lookups else "-",
                c.errors + c.timeouts,
                c.rejected,
                _human_bytes(c.bytes_read),
                _human_bytes(c.bytes_written),
                f"{c.saved_s:.1f}",
            ]
        )
    if not rows:
        print_lines(
            "",
            f"No cache activity recorded in {settings.cache_dir} yet (artifacts torch finds in its own "
            "cache on this machine, TORCHINDUCTOR_CACHE_DIR, never reach warmstart).",
            indent=2,
        )
    else:
        print_table(
            f"warmstart cache ({settings.cache_dir})",
            ["tier", "kind", "hits", "misses", "hit rate", "errors", "rejected", "bytes in", "bytes out", "saved s"],
            rows,
            justify=["left", "left", "right", "right", "right", "right", "right", "right", "right", "right"],
        )
        saved = {t: v["saved_wall_s"] for t, v in totals.items() if v["hits"]}
        if saved:
            print_lines(
                "",
                "saved s: per kind, what producing the entries that hit cost their producers, less the "
                "reads; kinds nest (an AOTAutograd entry's time includes its FX graphs', an FX graph's "
                "its C++ objects'), so the column adds up to more than the time saved. Wall time saved, "
                "estimated from each hit's outermost kind: "
                + ", ".join(f"{tier} {s:.1f} s" for tier, s in saved.items()),
                indent=2,
            )
    print_lines(
        "", f"local tier: {local['entries']} entries, {_human_bytes(local['bytes'])} of {_human_bytes(local['limit'])}"
    )
    counters = counts.counters_dict()
    if counters.get("recompiles"):
        print_lines("", f"recompilations: {counters['recompiles']}")
    if counters.get("leases") or counters.get("waits"):
        print_lines("", _single_flight_line(counters), indent=2)
    if counters.get("round_trips") or counters.get("round_trips_ahead"):
        print_lines("", _round_trips_line(counters), indent=2)


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
    keys = None
    url = settings.cache_url or ""
    if remote:
        # Checked before anything is removed: a command that fails removes nothing.
        if not url:
            raise click.UsageError("--remote needs WARMSTART_CACHE_URL")
        from warmstart.compile_cache.signing import keys_for

        keys = keys_for(settings.key_file, settings.secret)
        if keys is not None and not keys.can_sign:
            raise click.UsageError(
                f"--remote: WARMSTART_KEY_FILE {settings.key_file} is a public key, which can only "
                "read and verify: a job holding it never writes or deletes remote entries (use the "
                "signing key, signing.key, with the writer URL)"
            )
    if local_:
        local_tier = LocalTier(settings.cache_dir, settings.cache_size)
        removed = local_tier.clear()
        local_tier.close()
        stats_path(settings).unlink(missing_ok=True)
        click.echo(f"local: removed {removed} entries from {settings.cache_dir}")
    if remote:
        import redis

        ns = namespace(settings.namespace)
        remote_tier = RemoteTier(url, keys=keys, secret=None if keys is not None else b"-", namespace=ns)
        try:
            removed = remote_tier.clear()
        except redis.exceptions.NoPermissionError:
            raise click.ClickException(
                f"remote: could not clear namespace {ns}: the URL's user may not delete entries "
                "(a reader's URL can only read): use the writer URL (writer.url)"
            ) from None
        except Exception as exc:
            raise click.ClickException(f"remote: could not clear namespace {ns}: {exc}") from None
        finally:
            remote_tier.close()
        click.echo(f"remote: removed {removed} keys of namespace {ns}")


@group.command()
@json_option
def doctor(as_json: bool) -> None:
    """Check the configuration end to end and say what is wrong in plain words.

    Checks settings, the local directory, the server URL, authentication, the secret, the
    namespace, a write/read round trip and latency, and whether the server holds entries signed
    with other secrets (which this job never reads). Also warns when TMPDIR is too long for
    DataLoader workers' sockets (AF_UNIX paths: 107 bytes).

    Exit code 0 when every check passes (warnings allowed), 1 when a check fails, 2 when a
    setting is malformed. --json prints one object with these keys:

    \b
      ok              true unless a check failed
      checks          [{"name", "status": "ok" | "warn" | "fail", "detail"}], in the order run
      namespace       {"id", "components": {"format", "torch", "triton", "python_abi",
                      "cpu_isa", "gpu_arch", "user"}}; null without a remote tier to check
      key_id          key id of the signing key or secret in use; null without one
      key_id_entries  entries on the server under key_id; null when not counted
      other_key_ids   {key id: entries} signed with other keys; null when not counted

    \b
    Example:
      WARMSTART=1 WARMSTART_CACHE_URL=redis://writer:pw@cache:6379/0 \\
      WARMSTART_SECRET_FILE=/etc/warmstart/secret warmstart cache doctor --json
    """
    from warmstart.compile_cache.doctor import diagnose

    diagnosis = diagnose()
    if as_json:
        emit_json(diagnosis.to_dict())
    else:
        _print_checks(diagnosis.checks)
    if not diagnosis.settings_valid:
        raise SystemExit(2)
    if not diagnosis.ok:
        raise SystemExit(1)


def _print_checks(checks) -> None:
    from warmstart.compile_cache.doctor import FAIL, OK

    marks = {OK: "  ok", FAIL: "FAIL"}
    for check in checks:
        # Plain text, wrapped to the terminal: a detail quotes what the user gave (a URL, a path),
        # which is never read as markup.
        print_lines(f"{marks.get(check.status, 'warn')}  ", f"{check.name}: {check.detail}")


@group.command()
@click.argument("run_dir", required=False, type=click.Path(path_type=Path, file_okay=False, exists=True))
@json_option
def explain(run_dir: Path | None, as_json: bool) -> None:
    """Why the last job (or the job of RUN_DIR) missed the cache, and what to change.

    Every process of a job logs its misses with their reasons in RUN_DIR/cache-misses/. This
    command adds what the server knows: whether each missed entry exists for another namespace
    or signed with another key, and in which namespace components (torch version, CPU ISA,
    Python ABI, GPU arch, user namespace, ...) this machine differs from the entries it holds.
    Without RUN_DIR, the last job that missed with this machine's cache directory; when no job
    has missed there, the answer is that there are no misses (exit code 0).

    --json prints one object with these keys:

    \b
      reasons         {reason: count}; reasons: absent, evicted, other_key_id, rejected,
                      other_namespace, breaker_open, timeout, error; skipped is the sum
                      of the last three
      misses          [{"kind", "key", "reason", "tier", "detail"}], oldest first
      by_kind         {kind: {reason: count}}
      namespace_diff  components in which this machine differs from the closest namespace
                      the server holds entries for
      namespace       {"id", "key_id", "components"} of this machine
      others          [{"namespace", "key_id", "differs": {component: [this machine, theirs]}}]
      advice          what to change, one line each
      server          the server asked (password hidden), or why none was

    \b
    Example:
      warmstart cache explain warmstart-runs/job-1 --json
    """
    from warmstart.compile_cache.explain import Explanation
    from warmstart.compile_cache.explain import explain as explain_misses
    from warmstart.compile_cache.namespace import components, namespace
    from warmstart.config import Settings

    settings = Settings.from_env()
    try:
        result = explain_misses(settings, run_dir)
    except FileNotFoundError:
        # No job has logged a miss with this cache directory: a job whose every lookup hit logs none.
        # That is the answer, not a usage error.
        result = Explanation(
            None,
            [],
            namespace(settings.namespace),
            dict(components(settings.namespace)),
            "",
            [],
            [],
            "not asked: no misses to explain",
        )
    if as_json:
        emit_json(result.to_dict())
        return
    if result.run_dir is None:
        print_lines(
            "",
            f"no misses: no job has logged a cache miss in {settings.cache_dir} (a job whose every "
            "lookup hit logs none; so does one whose artifacts all came from torch's own cache on this "
            "machine, TORCHINDUCTOR_CACHE_DIR or /tmp/torchinductor_<user>, which warmstart neither sees "
            "nor copies to the shared cache)",
            indent=2,
        )
        return
    _print_explanation(result)


def _print_explanation(result) -> None:
    from rich.markup import escape

    from warmstart.compile_cache import KINDS

    console = terminal_console()
    total = len(result.misses)
    console.print(
        f"[bold]{total}[/] misses in {escape(str(result.run_dir))}; server: {escape(result.server)}", highlight=False
    )
    if total:
        by_kind = result.by_kind()
        reasons = result.columns()  # the reasons the misses gave (by_kind adds skipped, their sum)
        totals = collections.Counter(str(m["kind"]) for m in result.misses)
        rows = [
            [KINDS.get(kind, kind), *[counts.get(r, 0) for r in reasons], totals[kind]]
            for kind, counts in by_kind.items()
        ]
        print_table("misses by kind and reason", ["kind", *reasons, "total"], rows)
    if result.others:
        names = sorted(result.components)
        columns = ["component", "this machine", *[f"{o['namespace']} ({o['key_id']})" for o in result.others[:4]]]
        rows = [
            [
                name,
                _short(result.components.get(name, "")),
                *[_short(o["differs"].get(name, [None, "same"])[1]) for o in result.others[:4]],
            ]
            for name in names
        ]
        print_table("namespaces on the server", columns, rows, justify=["left"] * len(columns))
    if result.namespace_diff:
        console.print(f"this machine differs in: [bold]{escape(', '.join(result.namespace_diff))}[/]", highlight=False)
    for line in result.advice():
        console.print(f"- {escape(line)}", highlight=False)


def _short(text: str, width: int = 40) -> str:
    # A CPU's ISA list runs to 130 characters: the table shows its start, --json all of it.
    return text if len(text) <= width else text[: width - 1] + "…"


def _round_trips_line(counters: dict[str, float]) -> str:
    """One line: the round trips to the shared cache on lookups' paths and fetching ahead."""
    line = (
        f"round trips to the shared cache: {int(counters.get('round_trips', 0))} on lookups' paths, "
        f"{int(counters.get('round_trips_ahead', 0))} fetching ahead"
    )
    if counters.get("fetched_ahead"):
        line += (
            f"; {int(counters.get('fetched_ahead_hits', 0))} lookups served from "
            f"{int(counters['fetched_ahead'])} entries fetched ahead ({counters.get('fetch_ahead_wait_s', 0.0):.1f} s "
            "waited for them)"
        )
    return line


def _single_flight_line(counters: dict[str, float]) -> str:
    """One line: how often this cache's jobs compiled an entry once for others, and waited for one."""

    def n(name: str, word: str) -> str:
        count = int(counters.get(name, 0))
        return f"{count} {word}{'' if count == 1 else 's'}"

    line = (
        f"single-flight: {n('leases', 'lease')} taken (compiled for others), {n('waits', 'wait')} for "
        f"another process's compile ({counters.get('wait_s', 0.0):.1f} s), {n('takeovers', 'takeover')}"
    )
    if counters.get("wait_timeouts"):
        line += f", {n('wait_timeouts', 'wait')} past WARMSTART_COMPILE_WAIT_S"
    if counters.get("leases_lapsed"):
        line += f", {n('leases_lapsed', 'lease')} let go before its entry was stored"
    return line
