"""Helpers that turn bad field values into one SpecError naming every offending field."""

from __future__ import annotations

from collections.abc import Iterable

from spec.errors import SpecError


def require(problems: list[str], ok: bool, message: str) -> None:
    """Append ``message`` to ``problems`` when ``ok`` is false."""
    if not ok:
        problems.append(message)


def positive_ints(problems: list[str], owner: object, names: Iterable[str]) -> None:
    """Every named attribute of ``owner`` must be an int >= 1."""
    for name in names:
        value = getattr(owner, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be a positive integer, got {value!r}")


def raise_if(problems: list[str], what: str) -> None:
    """Raise one SpecError listing every problem, or return when there are none."""
    if problems:
        raise SpecError(f"invalid {what}: " + "; ".join(problems))
