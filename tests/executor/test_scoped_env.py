"""scoped_env: variables set for a block are removed after it, changed ones get their value back, on error too."""

from __future__ import annotations

import os

import pytest

from executor.scoped_env import scoped_env


def test_values_hold_inside_and_the_environment_comes_back_after_an_error(monkeypatch):
    monkeypatch.setenv("FOLDTUNE_TEST_KEPT", "before")
    monkeypatch.delenv("FOLDTUNE_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError):
        with scoped_env({"FOLDTUNE_TEST_KEPT": "inside", "FOLDTUNE_TEST_NEW": "1"}):
            assert os.environ["FOLDTUNE_TEST_KEPT"] == "inside" and os.environ["FOLDTUNE_TEST_NEW"] == "1"
            raise RuntimeError("the block failed")
    assert os.environ["FOLDTUNE_TEST_KEPT"] == "before"
    assert "FOLDTUNE_TEST_NEW" not in os.environ
