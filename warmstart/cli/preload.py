"""``warmstart preload start|status|stop``: the preloaded process jobs fork from (docs/preload.md).

A thin layer over :mod:`warmstart.preload`.
"""

from __future__ import annotations

import time

import click

from warmstart.cli._output import emit_json, json_option, print_table


@click.group()
def group() -> None:
    """Start processes without a new interpreter: a preloader they fork from.

    \b
    Example:
      warmstart preload start            # imports torch, TorchRec, the compiler once
      WARMSTART=1 torchrun --nproc-per-node 8 train.py   # every rank is forked from it
      warmstart preload status
      warmstart preload stop
    """


@group.command()
@click.option(
    "--modules", default="", help="More modules to import, comma-separated (added to WARMSTART_PRELOAD_MODULES)."
)
@click.option(
    "--socket",
    "socket_path",
    default=None,
    help="Where to listen. [default: $WARMSTART_PRELOAD_SOCKET, else a private path per user and environment]",
)
@click.option("--foreground", is_flag=True, help="Run in this process until SIGTERM (systemd, containers).")
@json_option
def start(modules, socket_path, foreground, as_json) -> None:
    """Start a preloader for this user, interpreter and environment; returns once it serves."""
    from rich.console import Console

    from warmstart.preload import control as preload

    wanted = [m.strip() for m in modules.split(",") if m.strip()]
    if foreground or as_json:
        result = preload.start(wanted, socket_path, foreground=foreground)
    else:
        with Console(stderr=True).status("importing torch, TorchRec and the compiler..."):
            result = preload.start(wanted, socket_path)
    if as_json:
        emit_json(result)
        return
    state = "already running" if result.get("already_running") else "started"
    click.echo(
        f"preloader {state}: pid {result['pid']}, {result['socket']}; imported "
        f"{', '.join(result['modules'])} in {result['imports_s']:.1f} s"
    )
    _echo_skipped(result)
    if result.get("missing_modules"):
        click.echo(
            f"  not among the running preloader's modules: {', '.join(result['missing_modules'])} "
            "(it was started without them: stop it and start it again to add them)"
        )


def _echo_skipped(status: dict) -> None:
    for name, reason in status.get("skipped", {}).items():
        click.echo(f"  not imported: {name} ({reason})")


@group.command()
@click.option("--socket", "socket_path", default=None, help="Only the preloader at this path.")
@json_option
def status(socket_path, as_json) -> None:
    """The preloaders of this user: what they serve, what they refused and why, fork safety."""
    from warmstart.preload import control as preload

    found = [s for s in ([preload.status(socket_path)] if socket_path else preload.preloaders()) if s]
    if as_json:
        emit_json({"preloaders": [{k: v for k, v in s.items() if k != "fingerprint"} for s in found]})
        return
    if not found:
        click.echo("no preloader is running for this user (start one: warmstart preload start)")
        return
    rows = []
    for s in found:
        safe = (
            "yes" if s["fork_safe"] else f"NO ({s['threads']} threads, CUDA {'on' if s['cuda_initialized'] else 'off'})"
        )
        rows.append(
            [
                str(s["pid"]),  # a process id, not a quantity: no thousands separator
                s["socket"],
                f"{time.time() - s['started_at']:.0f} s",
                s["served"],
                sum(s["refused"].values()),
                s["running"],
                safe,
                "yes" if s["stale"] else "no",
            ]
        )
    print_table("preloaders", ["pid", "socket", "up", "served", "refused", "running", "fork-safe", "stale"], rows)
    for s in found:
        _echo_skipped(s)
        for reason, count in sorted(s["refused"].items(), key=lambda kv: -kv[1]):
            click.echo(f"  refused {count}x: {reason}")
        files = s.get("files") or {}
        if files:
            click.echo(
                f"  imported files: {files['watched_directories']} directories watched (a change is known at once), "
                f"{files['polled_files']} files polled (on filesystems that report no changes)"
            )
        if s["stale"]:
            click.echo(f"  stale: {s['stale']}")


@group.command()
@click.option("--socket", "socket_path", default=None, help="The preloader at this path. [default: this environment's]")
@click.option("--all", "stop_all", is_flag=True, help="Every preloader of this user.")
def stop(socket_path, stop_all) -> None:
    """Stop a preloader: it serves no new process and ends when the programs it runs have ended."""
    from warmstart.preload import control as preload

    targets = (
        [s["socket"] for s in preload.preloaders()] if stop_all else [socket_path or preload.this_environment_socket()]
    )
    stopped = [path for path in targets if preload.stop(path) is not None]
    for path in stopped:
        click.echo(f"stopped the preloader at {path}")
    if not stopped:
        click.echo("no preloader was running there")
