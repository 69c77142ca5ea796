"""The ``warmstart`` command: a thin layer over the library, one module per noun.

Exit codes: 0 success, 2 bad usage or input (a ``ConfigError`` included), 1 any other failure. Errors
are one line on stderr; ``-v`` shows tracebacks.
"""

from __future__ import annotations

import click

from warmstart.errors import ConfigError, WarmstartError


class _Root(click.Group):
    def invoke(self, ctx: click.Context):  # one line per error, never a traceback unless -v
        try:
            return super().invoke(ctx)
        except click.exceptions.Exit:
            raise
        except click.UsageError as exc:
            # Every command's errors begin "warmstart:", click's usage errors too (not "Error:"),
            # and say where the accepted forms are.
            where = exc.ctx.command_path if exc.ctx is not None else "warmstart"
            click.echo(f"warmstart: {exc.format_message()} (see '{where} --help')", err=True)
            ctx.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"warmstart: {exc.format_message()}", err=True)
            ctx.exit(exc.exit_code)
        except ConfigError as exc:
            if ctx.obj and ctx.obj.get("verbose"):
                raise
            click.echo(f"warmstart: {exc}", err=True)
            ctx.exit(2)
        except WarmstartError as exc:
            if ctx.obj and ctx.obj.get("verbose"):
                raise
            click.echo(f"warmstart: {exc}", err=True)
            ctx.exit(1)


@click.group(cls=_Root, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and debug logs.")
@click.version_option(package_name="warmstart")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """warmstart: win back the wall time training jobs lose outside training.

    \b
    Example:
      warmstart cache stats
      warmstart ett report warmstart-runs/job-1
    """
    ctx.ensure_object(dict)["verbose"] = verbose
    if verbose:
        import logging

        logging.basicConfig(level=logging.DEBUG)


def _register() -> None:
    # Each noun lives in its own module; a module that is missing or broken must not take the
    # others down with it.
    import importlib

    for noun in ("cache", "server", "preload", "ett", "bench"):
        try:
            module = importlib.import_module(f"warmstart.cli.{noun}")
        except ModuleNotFoundError as exc:
            if exc.name != f"warmstart.cli.{noun}":
                raise
            continue
        cli.add_command(module.group, noun)


_register()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``warmstart`` console script."""
    cli.main(args=argv, prog_name="warmstart", standalone_mode=True)


if __name__ == "__main__":  # pragma: no cover
    main()
