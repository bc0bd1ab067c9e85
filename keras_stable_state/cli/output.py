"""Where the command line writes: rich tables on a terminal, plain aligned text when piped, JSON.

Every string read from a file goes through `safe` before it is printed,
so a key cannot move the cursor, recolour or rewrite the terminal. ``rich``
is imported only when writing to a terminal.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

from keras_stable_state.errors import shown

__all__ = [
    "PROGRESS_MIN_BYTES",
    "Printer",
    "cell",
    "human",
    "number",
    "print_json",
    "progress",
    "safe",
    "shape",
]

PROGRESS_MIN_BYTES = 32 * 2**20  # show a progress bar from this many array bytes on


def safe(text) -> str:
    """``text`` with control and other unprintable characters escaped (``\\x1b``, ``\\n``), so
    that a key read from a file cannot move the cursor, recolour or rewrite the terminal."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# The most characters a table cell or field shows of a name read from a file.
CELL_WIDTH = 200


def cell(text) -> str:
    """``text`` as `safe` makes it, shortened to about `CELL_WIDTH` characters
    (its start, then ``... (N characters)``): what tables and fields print of a key, so
    a key of a megabyte prints as one short line (``--json`` keeps it whole)."""
    return safe(shown(str(text), CELL_WIDTH, quote=False))


def isatty(stream) -> bool:
    """Whether ``stream`` is a terminal (``False`` for closed or fake streams)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def human(nbytes: int) -> str:
    """``nbytes`` as ``"12 B"``, ``"1.5 KiB"``, ``"3.0 MiB"`` or ``"2.1 GiB"``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover


def shape(dims) -> str:
    """A shape as Python prints a tuple: ``"(4, 8)"``."""
    return str(tuple(dims))


def number(value) -> str:
    """A difference as text: ``"0"``, 6 significant digits, or ``value`` itself when a string."""
    if isinstance(value, str):
        return value
    return "0" if value == 0 else f"{value:.6g}"


def print_json(doc: Any) -> None:
    """Print a JSON-ready document (a result's ``to_json()``) on stdout, indented."""
    print(json.dumps(doc, indent=2), file=sys.stdout)


class Printer:
    """Rich tables on a terminal, plain aligned text (no escape codes) elsewhere.

    Args:
        stream: Where to write; default ``sys.stdout`` at construction.
    """

    def __init__(self, stream=None):
        self.stream = sys.stdout if stream is None else stream
        self.rich = isatty(self.stream)
        self.console = None
        if self.rich:
            from rich.console import Console

            self.console = Console(file=self.stream, highlight=False)

    def line(self, text="", style=None):
        """One line; ``style`` (``"bold"``, ``"yellow"``) applies on a terminal only."""
        if self.rich:
            from rich.text import Text

            self.console.print(Text(safe(text), style=style or ""))
        else:
            print(safe(text), file=self.stream)

    def heading(self, text):
        """An empty line, then ``text`` in bold."""
        self.line()
        self.line(text, style="bold")

    def fields(self, pairs):
        """``(name, value)`` pairs as two aligned columns; pairs whose value is ``None`` are left out."""
        pairs = [(cell(k), v) for k, v in pairs if v is not None]
        width = max((len(k) for k, _ in pairs), default=0)
        if self.rich:
            from rich.table import Table
            from rich.text import Text

            table = Table.grid(padding=(0, 2))
            table.add_column(style="bold")
            table.add_column()
            for k, v in pairs:
                table.add_row(Text(k), Text(cell(v)))
            self.console.print(table)
        else:
            for k, v in pairs:
                print(f"  {k.ljust(width)}  {cell(v)}", file=self.stream)

    def table(self, title, columns, rows, right=()):
        """``columns``: header names; ``rows``: lists of cells; ``right``: right-aligned columns."""
        rows = [[cell(c) for c in row] for row in rows]
        if self.rich:
            from rich import box
            from rich.table import Table
            from rich.text import Text

            self.console.print()
            table = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD)
            for name in columns:
                table.add_column(name, justify="right" if name in right else "left", overflow="fold")
            for row in rows:
                table.add_row(*(Text(c) for c in row))
            self.console.print(table)
            return
        self.line()
        self.line(title)
        widths = [max([len(name)] + [len(r[i]) for r in rows]) for i, name in enumerate(columns)]

        def fmt(cells):
            out = [
                c.rjust(w) if name in right else c.ljust(w)
                for c, w, name in zip(cells, widths, columns, strict=True)
            ]
            return ("  " + "  ".join(out)).rstrip()

        self.line(fmt(list(columns)))
        for row in rows:
            self.line(fmt(row))


@contextlib.contextmanager
def progress(total_bytes, label):
    """Yield ``advance(nbytes)``; shows a bar on stderr from `PROGRESS_MIN_BYTES` on, on a terminal only."""
    if total_bytes < PROGRESS_MIN_BYTES or not isatty(sys.stderr):
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(label, total=total_bytes)
        yield lambda n: bar.advance(task, n)
