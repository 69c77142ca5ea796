"""The time-window options that ``warmstart ett report`` and ``warmstart ett fleet`` share: ``--since``,
``--until``, ``--every`` and ``--exclude``, parsed by ``warmstart.metrics.windows`` into a ``TimeFilter``.

Bad values are click usage errors (exit code 2) that name the option, the value and what is accepted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import click

from warmstart.metrics.windows import (
    DURATION_FORMS,
    RANGE_FORMS,
    TIME_FORMS,
    TimeFilter,
    format_time,
    parse_duration,
    parse_range,
    parse_time,
)


class _Parsed(click.ParamType):
    """A click type over one of the ``parse_*`` functions: their ValueError becomes a usage error."""

    def __init__(self, name: str, parse: Callable[[str], Any]) -> None:
        self.name = name
        self._parse = parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):  # a default, or a value already converted
            return value
        try:
            return self._parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


TIME = _Parsed("T", parse_time)
DURATION = _Parsed("DURATION", parse_duration)
RANGE = _Parsed("T1..T2", parse_range)


def window_options(func: Callable) -> Callable:
    """Add ``--since``, ``--until``, ``--every`` and ``--exclude`` (see :func:`time_filter`)."""
    options = [
        click.option("--since", type=TIME, default=None, help=f"Count only time from T on; T is {TIME_FORMS}."),
        click.option("--until", type=TIME, default=None, help="Count only time before T."),
        click.option(
            "--every",
            type=DURATION,
            default=None,
            help=f"Also report ETT% of consecutive windows of this length: {DURATION_FORMS}.",
        ),
        click.option(
            "--exclude",
            type=RANGE,
            multiple=True,
            help=f"Leave a range out of every total (e.g. a maintenance window): {RANGE_FORMS}. Repeatable.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def time_filter(
    since: float | None, until: float | None, every: float | None, exclude: Sequence[tuple[float, float]]
) -> TimeFilter | None:
    """The options as a :class:`TimeFilter`, or None when none was given.

    Raises:
        click.UsageError: ``--since`` is not before ``--until``.
    """
    if since is None and until is None and every is None and not exclude:
        return None
    if since is not None and until is not None and since >= until:
        raise click.UsageError(
            f"--since {format_time(since)} is not before --until {format_time(until)}: expected a non-empty interval"
        )
    return TimeFilter(since=since, until=until, exclude=tuple(exclude), every=every)


@contextlib.contextmanager
def every_usage_errors() -> Iterator[None]:
    """Turn the ValueError of a window series too long for ``--every`` into a usage error on ``--every``."""
    try:
        yield
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--every'") from None
