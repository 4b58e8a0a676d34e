"""The one way the ``amanda`` command prints a table.

Every subcommand hands its rows to :func:`print_table`: on a terminal with
`rich <https://github.com/Textualize/rich>`_ installed the table is drawn by
rich; otherwise (a pipe, a file, a test, ``AMANDA_PLAIN=1``, no rich) it is
plain text, columns separated by two spaces and aligned, a dashed rule under
the header, so ``grep``/``awk`` and diffs read it line by line.

Example::

    from amanda.cli.table import print_table
    print_table(["op type", "ops"], [["conv2d", 4], ["linear", 2]], "<>",
                title="cnn: 6 ops")
"""

from __future__ import annotations

import os
import sys
import textwrap

__all__ = ["Table", "format_plain", "print_table", "print_table_object", "use_rich"]

GAP = "  "


class Table:
    """Headers, rows and per-column alignment of one table.

    Args:
        headers: the column titles.
        rows: lists of cells (anything; shown with ``str``).
        align: one of ``<`` (left) or ``>`` (right) per column; numbers
            read best right-aligned. Default: first column left, others right.
        title: a line shown above the table.
        footer: rows shown under a second rule (totals).
        notes: lines shown under the table.
    """

    __slots__ = ("headers", "rows", "align", "title", "footer", "notes")

    def __init__(self, headers, rows, align=None, title=None, footer=(), notes=()):
        self.headers = [str(h) for h in headers]
        self.rows = [[_cell(c) for c in row] for row in rows]
        self.footer = [[_cell(c) for c in row] for row in footer]
        if align is None:
            align = "<" + ">" * (len(self.headers) - 1)
        if len(align) != len(self.headers) or set(align) - {"<", ">"}:
            raise ValueError(f"align needs one of '<'/'>' per column, got {align!r} for "
                             f"{len(self.headers)} columns")
        self.align = align
        self.title = title
        self.notes = list(notes)


def _cell(value):
    return "-" if value is None else str(value)


def use_rich(stream=None):
    """Whether tables go through rich: ``stream`` (default stdout) is a
    terminal, ``AMANDA_PLAIN`` is unset and rich is importable."""
    stream = sys.stdout if stream is None else stream
    if os.environ.get("AMANDA_PLAIN") or not getattr(stream, "isatty", lambda: False)():
        return False
    from amanda.runtime.backends import installed
    return installed("rich")


def format_plain(table):
    """The table as aligned plain text (no trailing spaces)."""
    body = [table.headers] + table.rows + table.footer
    widths = [max(len(line[i]) if i < len(line) else 0 for line in body)
              for i in range(len(table.headers))]

    def line(cells):
        padded = [f"{c:{a}{w}}" for c, a, w in zip(cells, table.align, widths)]
        return GAP.join(padded).rstrip()

    rule = GAP.join("-" * w for w in widths)
    lines = [table.title] if table.title else []
    lines += [line(table.headers), rule] + [line(row) for row in table.rows]
    if table.footer:
        lines += [rule] + [line(row) for row in table.footer]
    return "\n".join(lines + table.notes)


def _print_rich(table, file, indent):
    from rich import box
    from rich.console import Console
    from rich.table import Table as RichTable
    rich_table = RichTable(title=table.title, title_justify="left", box=box.SIMPLE_HEAD,
                           show_footer=False)
    for header, align in zip(table.headers, table.align):
        rich_table.add_column(header, justify="right" if align == ">" else "left")
    for i, row in enumerate(table.rows):
        rich_table.add_row(*row, end_section=(i == len(table.rows) - 1 and bool(table.footer)))
    for row in table.footer:
        rich_table.add_row(*row, style="bold")
    from rich.padding import Padding
    console = Console(file=file, highlight=False)
    console.print(Padding(rich_table, (0, 0, 0, indent)))
    for note in table.notes:
        console.print(Padding(note, (0, 0, 0, indent)), markup=False)


def print_table(headers, rows, align=None, title=None, footer=(), notes=(), file=None,
                indent=0):
    """Print one table: rich on a terminal, aligned plain text otherwise.

    Args:
        headers, rows, align, title, footer, notes: see :class:`Table`.
        file: the stream (default: ``sys.stdout``).
        indent: spaces before every line.
    """
    print_table_object(Table(headers, rows, align, title=title, footer=footer, notes=notes),
                       file=file, indent=indent)


def print_table_object(table, file=None, indent=0):
    """Print a :class:`Table` built beforehand; see :func:`print_table`."""
    file = sys.stdout if file is None else file
    if use_rich(file):
        _print_rich(table, file, indent)
    else:
        text = format_plain(table)
        print(textwrap.indent(text, " " * indent) if indent else text, file=file)
