"""A registry of feature entries by name: what each layer keeps per attention kind (and per future feature).

The spec layer registers a feature's declarative entry (``spec.attention_kinds``), the cost model its pricing
and the executor its module factory, each in a :class:`Registry` keyed by the same name;
``tests/test_feature_registry.py`` checks that the three hold the same names.
"""

from __future__ import annotations

from typing import TypeVar

from spec.errors import InvalidConfigError

_E = TypeVar("_E")


class Registry(dict[str, _E]):
    """Entries by name, each name registered once; ``what`` names the entries in errors."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def add(self, name: str, entry: _E) -> _E:
        """Register ``entry`` under ``name``; ValueError when the name is taken. Returns ``entry``."""
        if name in self:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self[name] = entry
        return entry

    def require(self, name: str, missing: str, listed: str) -> _E:
        """The entry ``name``; InvalidConfigError "<missing> 'name'; <listed>: a, b" when none is registered."""
        entry = self.get(name)
        if entry is None:
            raise InvalidConfigError(f"{missing} {name!r}; {listed}: {', '.join(self)}")
        return entry
