"""Output helpers every report command shares: ``--json`` and aligned tables."""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from rich.console import Console, JustifyMethod


def json_option(func: Callable) -> Callable:
    """Add ``--json`` (machine-readable output with stable keys, on stdout)."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON with stable keys instead of a table.")(func)


def emit_json(obj: Any) -> None:
    """Write ``obj`` as indented JSON on stdout."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def output_width() -> int | None:
    """The width output must fit: ``COLUMNS`` when set, else 80 when stdout is not a terminal
    (a pipe, a file, CI's log); ``None``: the terminal's own width."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return None if sys.stdout.isatty() else 80


def terminal_console() -> Console:
    """A rich console on stdout that wraps at :func:`output_width` (plain text when not a terminal)."""
    from rich.console import Console

    return Console(width=output_width())


def print_lines(mark: str, text: str, *, indent: int | None = None) -> None:
    """Print ``mark`` then ``text``, wrapped at :func:`output_width` with a hanging indent; words are
    never split (a path or URL stays whole, so it can be copied)."""
    width = output_width() or shutil.get_terminal_size().columns
    lines = textwrap.wrap(
        text,
        width=max(width, 40),
        initial_indent=mark,
        subsequent_indent=" " * (len(mark) if indent is None else indent),
        break_long_words=False,
        break_on_hyphens=False,
    )
    click.echo("\n".join(lines) or mark.rstrip())


def print_table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    justify: Sequence[JustifyMethod] | None = None,
) -> None:
    """Print an aligned table fitting :func:`output_width`: when the cells' natural widths do not
    fit, the columns with the most room to give wrap at spaces first (headers included), and only
    a column whose longest word does not fit is folded."""
    from rich import box
    from rich.table import Table

    cells = [[_cell(v) for v in row] for row in rows]
    width = output_width() or shutil.get_terminal_size().columns
    widths = fit_widths([[col, *(row[i] for row in cells)] for i, col in enumerate(columns)], width, gap=2)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, header_style="bold")
    table.padding = (0, 1, 0, 0)  # with the box's blank vertical: two spaces between columns
    table.pad_edge = False
    for i, col in enumerate(columns):
        align = justify[i] if justify else ("left" if i == 0 else "right")
        table.add_column(col, justify=align, overflow="fold", width=widths[i])
    for row in cells:
        table.add_row(*row)
    terminal_console().print(table)


def fit_widths(columns: Sequence[Sequence[str]], width: int, *, gap: int) -> list[int]:
    """Widths for ``columns`` (each its header then its cells) so that they and the ``gap`` between
    them fit in ``width``. From each column's natural width, narrowed one character at a time where
    the most room is: first headers wrap at spaces (down to the cells' width), then cells (down to
    their longest word), and last the widest columns fold."""

    def longest(texts: Sequence[str], words: bool) -> int:
        parts = [p for t in texts for p in (t.split() if words else t.splitlines())]
        return max((len(p) for p in parts), default=1)

    natural = [longest(col, False) for col in columns]
    wrapped_header = [max(longest(col[1:], False), longest(col[:1], True)) for col in columns]
    wrapped_cells = [longest(col, True) for col in columns]
    widths = list(natural)
    room = width - gap * (len(columns) - 1)
    for floor in (wrapped_header, wrapped_cells, [1] * len(columns)):
        while sum(widths) > room:
            slack = [w - f for w, f in zip(widths, floor, strict=True)]
            if max(slack) <= 0:
                break
            widths[slack.index(max(slack))] -= 1
    return widths


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
