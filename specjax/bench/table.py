"""The benches' tables: aligned columns, and the legend printed under a table that says what
each of its columns (and any figure printed after it) means, so a printed run explains itself."""
from __future__ import annotations

import dataclasses
import math
import textwrap
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Column:
    """One column: its header, what it means (the legend's line for it), the width of its
    cells (at least the header's) and how a number is written (`fmt.format(value)`); strings
    are written as they are."""

    name: str
    meaning: str
    width: int = 0
    fmt: str = "{:.2f}"
    left: bool = False

    def cell(self, value) -> str:
        text = value if isinstance(value, str) else self.fmt.format(value)
        if not isinstance(value, str) and isinstance(value, float) and math.isnan(value):
            text = "-"  # a figure this run did not measure (e.g. transformers with --no-hf)
        width = max(self.width, len(self.name))
        return f"{text:<{width}}" if self.left else f"{text:>{width}}"


@dataclasses.dataclass(frozen=True)
class Table:
    """Columns printed side by side, and notes: (term, meaning) pairs the legend explains after
    the columns (figures printed outside the table)."""

    columns: Sequence[Column]
    notes: Sequence[tuple[str, str]] = ()

    def __post_init__(self):
        names = [c.name for c in self.columns]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:  # the legend could not say which one it explains
            raise ValueError(f"repeated column names {repeated}")

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    def header(self) -> str:
        return " ".join(c.cell(c.name) for c in self.columns).rstrip()

    def row(self, *values) -> str:
        if len(values) != len(self.columns):
            raise ValueError(f"{len(values)} values for {len(self.columns)} columns")
        return " ".join(c.cell(v) for c, v in zip(self.columns, values)).rstrip()

    def legend(self, width: int = 100) -> str:
        """One entry per column, in the table's order, then the notes: `name: meaning`,
        wrapped to `width` with continuation lines indented."""
        entries = [(c.name, c.meaning) for c in self.columns] + list(self.notes)
        lines = []
        for term, meaning in entries:
            lines += textwrap.wrap(f"{term}: {meaning}", width, subsequent_indent="    ",
                                   break_on_hyphens=False)
        return "\n".join(lines)
