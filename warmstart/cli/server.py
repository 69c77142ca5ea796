"""``warmstart server start|status|stop``: the shared cache server (docs/reference.md#commands).

A thin layer over :mod:`warmstart.server`. Options left out of ``start`` take the values the
previous start from the same ``--dir`` used (kept in ``state.json``), then the defaults, so a
plain ``warmstart server start --dir D`` brings back the same server with the same credentials.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from warmstart.cli._output import emit_json, json_option, print_table
from warmstart.config import parse_size, server_settings

if TYPE_CHECKING:
    from warmstart.server import ServerOptions

_DIR_OPTION = click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Server directory: config, secrets, logs, data. "
    "[default: $WARMSTART_SERVER_DIR, else ~/.local/state/warmstart/server]",
)


@click.group()
def group() -> None:
    """Run the shared cache server: real Redis with LRU eviction, writer/reader credentials, TLS.

    \b
    Example:
      warmstart server start --dir /srv/warmstart --maxmemory 8GiB --bind 0.0.0.0 \\
          --tls-cert /etc/warmstart/cert.pem --tls-key /etc/warmstart/key.pem
      # a job that fills the cache (CI):
      export WARMSTART=1 WARMSTART_CACHE_URL="$(cat /srv/warmstart/writer.url)" \\
          WARMSTART_KEY_FILE=/srv/warmstart/signing.key
      # every other job:
      export WARMSTART=1 WARMSTART_CACHE_URL="$(cat /srv/warmstart/reader.url)" \\
          WARMSTART_KEY_FILE=/srv/warmstart/verify.pub
    """


@group.command()
@click.option("--port", type=int, default=None, help="Client port (a Cluster uses PORT..PORT+N-1). [default: 6379]")
@click.option("--bind", default=None, help="Address to listen on. [default: 127.0.0.1]")
@click.option("--maxmemory", default=None, help="Cache size in total, e.g. 8GiB; LRU eviction past it. [default: 1GiB]")
@_DIR_OPTION
@click.option("--cluster", type=int, default=None, help="Start N masters as a Redis Cluster (N >= 3; 0: one node).")
@click.option("--foreground", is_flag=True, help="Stay in the foreground until SIGTERM/SIGINT (systemd, containers).")
@click.option(
    "--tls-cert",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Server certificate (PEM): TLS only, rediss:// URLs.",
)
@click.option(
    "--tls-key", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Private key of --tls-cert (PEM)."
)
@click.option(
    "--tls-ca",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="CA clients verify the server with. [default: the certificate itself]",
)
@click.option("--no-tls", is_flag=True, help="Turn TLS off when a previous start from --dir had it on.")
@click.option("--aof/--no-aof", default=None, help="Persist the cache in an append-only file. [default: off]")
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics at :PORT/metrics (0: off).")
@click.option("--advertise", default=None, help="Host name put in the URLs. [default: the bind address]")
@click.option(
    "--show-secrets",
    is_flag=True,
    help="Also print the writer and reader URLs, passwords included (default: only the files holding them).",
)
@json_option
def start(
    port,
    bind,
    maxmemory,
    directory,
    cluster,
    foreground,
    tls_cert,
    tls_key,
    tls_ca,
    no_tls,
    aof,
    metrics_port,
    advertise,
    show_secrets,
    as_json,
) -> None:
    """Start the cache server and say where its credentials are.

    Returns once every node answers (a Cluster: once it serves every slot). Passwords, the writer
    and reader URLs (writer.url, reader.url) and the Ed25519 signing key are generated into --dir
    (mode 0600; the public verify.pub 0644) and reused on later starts. Nothing secret is printed
    unless --show-secrets is given: stdout of a service ends up in logs.

    \b
    Example:
      warmstart server start --dir ./cache-server --port 6390 --maxmemory 4GiB
      warmstart server start --dir ./cache-server --cluster 3 --json
    """
    from warmstart import server

    directory = directory or _default_dir()
    options = _merge_with_previous(
        directory,
        port=port,
        bind=bind,
        cluster=cluster,
        aof=aof,
        advertise=advertise,
        maxmemory=parse_size(maxmemory, "--maxmemory") if maxmemory is not None else None,
        metrics_port=metrics_port,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_ca=tls_ca,
        no_tls=no_tls,
    )
    if foreground:
        code = server.run_foreground(options, on_ready=lambda state: _print_started(state, as_json, show_secrets))
        raise SystemExit(code)
    _print_started(server.start(options), as_json, show_secrets)


@group.command()
@_DIR_OPTION
@json_option
def status(directory, as_json) -> None:
    """Health and usage: memory, keys, evictions, hit rate, clients, bytes per namespace.

    Exit code 0 when the server is up, 1 when it is down or was never started.

    \b
    Example:
      warmstart server status --dir ./cache-server --json
    """
    from warmstart import server

    directory = directory or _default_dir()
    result = server.collect(directory)
    if result is None:
        if as_json:
            emit_json({"dir": str(directory), "up": False, "error": "no server was started from this directory"})
        else:
            click.echo(f"warmstart: no server was started from {directory}", err=True)
        raise SystemExit(1)
    if as_json:
        emit_json(result.to_dict())
    else:
        _print_status(result)
    raise SystemExit(0 if result.up else 1)


@group.command()
@_DIR_OPTION
@json_option
def stop(directory, as_json) -> None:
    """Shut the server down cleanly and wait until its processes have exited.

    \b
    Example:
      warmstart server stop --dir ./cache-server
    """
    from warmstart import server

    directory = directory or _default_dir()
    stopped = server.stop(directory)
    if as_json:
        emit_json({"dir": str(directory), "stopped_pids": stopped})
    elif stopped:
        click.echo(f"stopped the server in {directory} (pids {', '.join(map(str, stopped))})")
    else:
        click.echo(f"no server was running from {directory}")


@group.command()
@_DIR_OPTION
@click.option(
    "--user",
    "users",
    multiple=True,
    type=click.Choice(["writer", "reader", "admin"]),
    help="Give this user a new password (repeatable).",
)
@click.option("--secret", is_flag=True, help="Replace the HMAC secret (every job using it must get the new file).")
@click.option(
    "--key-pair",
    is_flag=True,
    help="Replace the Ed25519 key pair: writers need the new signing.key, readers the new verify.pub.",
)
@json_option
def rotate(directory, users, secret, key_pair, as_json) -> None:
    """Replace passwords, the signing key pair and/or the HMAC secret; a running server takes new passwords at once.

    Old passwords stop working at once: Redis closes open connections on reload and only clients
    with the new password get back in. Entries signed with an old key live under the old key id:
    jobs holding the new key miss them (and write them again under the new id), jobs still on the
    old key keep reading them until they get the new file.

    \b
    Example:
      warmstart server rotate --dir ./cache-server --user writer
      warmstart server rotate --dir ./cache-server --key-pair
    """
    from warmstart.server import Credentials
    from warmstart.server.config import URL_FILES
    from warmstart.server.credentials import rotate as rotate_files
    from warmstart.server.process import reload_acl

    directory = directory or _default_dir()
    if not users and not secret and not key_pair:
        raise click.UsageError("nothing to rotate: give --user NAME, --key-pair and/or --secret")
    try:
        old = Credentials.load(directory)
    except OSError:
        raise click.UsageError(f"no server credentials in {directory}") from None
    new = rotate_files(directory, tuple(users), secret, key_pair)
    nodes = reload_acl(directory, old, new) if users else 0
    result = {
        "dir": str(directory),
        "rotated_users": list(users),
        "rotated_secret": secret,
        "rotated_key_pair": key_pair,
        "nodes_reloaded": nodes,
        "writer_url_file": str(directory / URL_FILES["writer"]),
        "reader_url_file": str(directory / URL_FILES["reader"]),
        "secret_file": str(new.secret_file),
        "signing_key_file": str(new.signing_key_file),
        "verify_key_file": str(new.verify_key_file),
    }
    if as_json:
        emit_json(result)
        return
    if users:
        click.echo(
            f"new password for {', '.join(users)}; {nodes} running node(s) reloaded. New URLs: "
            f"{result['writer_url_file']}, {result['reader_url_file']}"
        )
    if secret:
        click.echo(f"new HMAC secret in {new.secret_file}: give it to every job that uses it (WARMSTART_SECRET_FILE)")
    if key_pair:
        click.echo(
            f"new key pair (key id {new.key_id()}): writers need {new.signing_key_file}, readers "
            f"{new.verify_key_file} (WARMSTART_KEY_FILE)"
        )


# -- helpers ----------------------------------------------------------------------------------


def _default_dir() -> Path:
    return server_settings().dir


def _merge_with_previous(
    directory: Path,
    *,
    port: int | None,
    bind: str | None,
    cluster: int | None,
    aof: bool | None,
    advertise: str | None,
    maxmemory: int | None,
    metrics_port: int | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_ca: Path | None,
    no_tls: bool,
) -> ServerOptions:
    """The options of this start: those given (``None``: not given; ``metrics_port`` 0: off), else
    the previous start's from ``directory``, else the defaults."""
    from warmstart.server import ServerOptions, ServerState

    if no_tls and tls_cert is not None:
        raise click.UsageError("--no-tls and --tls-cert contradict each other")
    state = ServerState.load(directory) if (directory / "state.json").exists() else None
    previous = state.options if state is not None else ServerOptions(dir=directory)
    # A new certificate comes with its own key and CA: none of the previous three is kept then.
    keep_tls = not no_tls and tls_cert is None
    return ServerOptions(
        dir=directory,
        port=previous.port if port is None else port,
        bind=previous.bind if bind is None else bind,
        maxmemory=previous.maxmemory if maxmemory is None else maxmemory,
        cluster=previous.cluster if cluster is None else cluster,
        aof=previous.aof if aof is None else aof,
        tls_cert=tls_cert if tls_cert is not None else (previous.tls_cert if keep_tls else None),
        tls_key=tls_key if tls_key is not None else (previous.tls_key if keep_tls else None),
        tls_ca=tls_ca if tls_ca is not None else (previous.tls_ca if keep_tls else None),
        metrics_port=previous.metrics_port if metrics_port is None else (metrics_port or None),
        advertise=previous.advertise if advertise is None else advertise,
    )


def _print_started(state, as_json: bool, show_secrets: bool = False) -> None:
    import shlex

    from warmstart.server import Credentials
    from warmstart.server.config import URL_FILES

    creds = Credentials.load(state.options.dir)
    opts = state.options
    info = {
        "dir": str(opts.dir),
        "writer_url_file": str(opts.dir / URL_FILES["writer"]),
        "reader_url_file": str(opts.dir / URL_FILES["reader"]),
        "signing_key_file": str(creds.signing_key_file),
        "verify_key_file": str(creds.verify_key_file),
        "key_id": creds.key_id(),
        "secret_file": str(creds.secret_file),
        "mode": "cluster" if opts.cluster else "single",
        "nodes": [{"host": opts.host, "port": p, "pid": pid} for p, pid in zip(opts.ports, state.pids, strict=False)],
        "maxmemory": opts.maxmemory,
        "tls": opts.tls,
        "aof": opts.aof,
        "metrics_url": f"http://{opts.host}:{opts.metrics_port}/metrics" if opts.metrics_port else None,
    }
    if show_secrets:
        info.update(writer_url=state.url("writer", creds), reader_url=state.url("reader", creds))
    if as_json:
        emit_json(info)
    else:
        shape = f"Redis Cluster of {opts.cluster} masters" if opts.cluster else "one Redis node"
        click.echo(
            f"warmstart cache server up: {shape} on {opts.host}:{opts.ports[0]}, maxmemory "
            f"{_size(opts.maxmemory)} (allkeys-lru), TLS {'on' if opts.tls else 'off'}, "
            f"AOF {'on' if opts.aof else 'off'}"
        )
        rows = [
            ("writer URL", info["writer_url_file"], "file, 0600: WARMSTART_CACHE_URL for jobs that fill the cache"),
            ("reader URL", info["reader_url_file"], "file, 0600: WARMSTART_CACHE_URL for read-only consumers"),
            (
                "signing key",
                info["signing_key_file"],
                f"0600: WARMSTART_KEY_FILE for writer jobs; key id {info['key_id']}",
            ),
            ("verify key", info["verify_key_file"], "public: WARMSTART_KEY_FILE for reader jobs"),
            ("dir", info["dir"], f"stop with: warmstart server stop --dir {opts.dir}"),
        ]
        if show_secrets:
            rows[2:2] = [
                ("writer url", info["writer_url"], "secret: the password is in it"),
                ("reader url", info["reader_url"], "secret: the password is in it"),
            ]
        if info["metrics_url"]:
            rows.append(("metrics", info["metrics_url"], "Prometheus scrape target"))
        for name, value, hint in rows:
            click.echo(f"  {name:<12} {value}\n  {'':<12} ({hint})")
        q = shlex.quote
        click.echo(
            "Jobs that fill the cache (CI, trusted pipelines):\n"
            f'  export WARMSTART=1 WARMSTART_CACHE_URL="$(cat {q(info["writer_url_file"])})" '
            f"WARMSTART_KEY_FILE={q(info['signing_key_file'])}\n"
            "Every other job (copy verify.pub to it; it cannot sign, so it never writes):\n"
            f'  export WARMSTART=1 WARMSTART_CACHE_URL="$(cat {q(info["reader_url_file"])})" '
            f"WARMSTART_KEY_FILE={q(info['verify_key_file'])}"
        )
    sys.stdout.flush()  # --foreground keeps running: whoever reads stdout needs the file names now
    _warn_plaintext(opts)


def _warn_plaintext(options) -> None:
    """One line on stderr when a plaintext server will listen beyond this host."""
    from warmstart.server.config import is_loopback

    if not options.tls and not is_loopback(options.bind):
        click.echo(
            f"warmstart: warning: serving plaintext on {options.bind}: passwords and cache entries cross the "
            "network unencrypted; use --tls-cert/--tls-key unless every client is on a trusted network",
            err=True,
        )


def _print_status(result) -> None:
    shape = f"cluster, {result.nodes_up}/{len(result.nodes)} nodes up" if result.mode == "cluster" else "single node"
    click.echo(
        f"warmstart cache server in {result.dir}: {'UP' if result.up else 'DOWN'} ({shape}, "
        f"TLS {'on' if result.tls else 'off'})"
    )
    hit = "-" if result.hit_rate is None else f"{result.hit_rate * 100:.1f}%"
    print_table(
        None,
        ["", "value"],
        [
            ("memory used / max", f"{_size(result.used_memory)} / {_size(result.maxmemory)}"),
            ("keys", result.keys),
            ("evicted keys", result.evicted_keys),
            ("hit rate", f"{hit} ({result.keyspace_hits:,} hits, {result.keyspace_misses:,} misses)"),
            ("connected clients", result.connected_clients),
        ],
    )
    if result.mode == "cluster" or not result.up:
        print_table(
            "nodes",
            ["node", "up", "pid", "memory", "keys", "evicted", "clients", "error"],
            [
                (
                    f"{n.host}:{n.port}",
                    "yes" if n.up else "NO",
                    n.pid,
                    _size(n.used_memory),
                    n.keys,
                    n.evicted_keys,
                    n.connected_clients,
                    n.error,
                )
                for n in result.nodes
            ],
        )
    if result.namespace_bytes:
        title = "bytes per namespace" + ("" if result.namespace_bytes_exact else " (sampled estimate)")
        print_table(title, ["namespace", "bytes"], [(ns, _size(b)) for ns, b in result.namespace_bytes.items()])


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
