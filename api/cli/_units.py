"""One unit per quantity in everything the CLI prints: durations in seconds (as the API's ``*_s`` fields), four
significant digits, so a CPU rank's 0.05312 s step and a 12.35 s step of a large model read alike; a table
says "(s)" in its column header and prints bare numbers."""

from __future__ import annotations


def seconds(value: float | None) -> str:
    """``value`` seconds as text with its unit; ``-`` for none."""
    return "-" if value is None else f"{value:.4g} s"


def seconds_cell(value: float | None) -> str:
    """``value`` seconds for a column whose header says (s); ``-`` for none."""
    return "-" if value is None else f"{value:.4g}"


def column_width(values, header: str, least: int = 0) -> int:
    """The width a text column needs to print every value whole (tables never cut names or layouts)."""
    return max([len(header), least, *(len(str(v)) for v in values)])
