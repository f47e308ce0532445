"""The small exception hierarchy every foldtune package raises from.

Everything a user can get wrong (an unknown model, a layout that does not divide the world, a malformed
catalog file) raises a subclass of :class:`FoldtuneError`, whose message is one readable line naming the
offending values. Front ends (CLI, HTTP) catch ``FoldtuneError`` and never show a traceback.
"""


class FoldtuneError(Exception):
    """Base class of every error foldtune raises on purpose."""


class SpecError(FoldtuneError, ValueError):
    """A model, training, hardware or cluster spec is malformed (a value out of range or inconsistent)."""


class CatalogError(FoldtuneError, KeyError):
    """A name is not in the catalog, or a catalog file cannot be read."""

    def __str__(self) -> str:  # KeyError quotes its message; we want the plain sentence
        return str(self.args[0]) if self.args else ""


class InvalidConfigError(FoldtuneError, ValueError):
    """A parallel configuration breaks a structural or model-dependent validity rule."""
