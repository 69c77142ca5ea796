"""Output helpers every report command shares: ``--json`` and aligned tables."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from rich.console import JustifyMethod


def json_option(func: Callable) -> Callable:
    """Add ``--json`` (machine-readable output with stable keys, on stdout)."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON with stable keys instead of a table.")(func)


def emit_json(obj: Any) -> None:
    """Write ``obj`` as indented JSON on stdout."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def print_table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    justify: Sequence[JustifyMethod] | None = None,
) -> None:
    """Print an aligned table with rich (plain text when stdout is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_edge=False, header_style="bold")
    for i, col in enumerate(columns):
        table.add_column(col, justify=(justify[i] if justify else ("left" if i == 0 else "right")), no_wrap=True)
    for row in rows:
        table.add_row(*[_cell(v) for v in row])
    console = Console()
    # Piped output (CI logs, `| less`) gets a wide virtual terminal rather than wrapped cells.
    (console if console.is_terminal else Console(width=200)).print(table)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
