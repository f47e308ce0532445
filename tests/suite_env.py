"""Which FOLDTUNE_* variables a test session keeps (tests/conftest.py drops the others)."""

from __future__ import annotations

from collections.abc import Iterable

# The FOLDTUNE_* variables the suite sets or reads on purpose: this session's mark (tests/conftest.py), what CI
# demands (.ci/run) and the test database's override (docs/service.md, "Tests"). Every other one is the user's
# own foldtune setting (FOLDTUNE_API_KEY, FOLDTUNE_DATA_DIR, FOLDTUNE_RAY_ADDRESS, ...) and would steer the tests.
SUITE_VARIABLES = frozenset({"FOLDTUNE_TEST_SESSION", "FOLDTUNE_TEST_POSTGRES_URL", "FOLDTUNE_REQUIRE_POSTGRES",
                             "FOLDTUNE_REQUIRE_BROWSER"})


def foreign_foldtune_variables(environ: Iterable[str]) -> list[str]:
    """The FOLDTUNE_* names in ``environ`` that the suite does not set itself."""
    return sorted(name for name in environ if name.startswith("FOLDTUNE_") and name not in SUITE_VARIABLES)
