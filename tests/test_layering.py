"""The package layering of docs/architecture.md, read from the source: who may import whom, and where an
import may sit inside a function. A change that breaks a rule fails here with the offending lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spec", "costmodel", "planner", "executor", "db", "api")

# Which of our packages each package may import (dependencies point down, never back).
ALLOWED = {
    "spec": set(),
    "costmodel": {"spec"},
    "planner": {"spec", "costmodel"},
    "executor": {"spec"},
    "db": {"spec"},
    "api": {"spec", "costmodel", "planner", "executor", "db"},
}
# Packages where no import may sit inside a function (the CLI keeps torch, Ray and the worker out of its
# light commands that way, each with a comment; nothing else needs to).
NO_FUNCTION_IMPORTS = ("spec", "costmodel", "planner", "executor", "db", "api/http", "api/service", "api/worker")


def _sources(top: str):
    for path in sorted((ROOT / top).rglob("*.py")):
        if "migrations" not in path.parts:
            yield path, ast.parse(path.read_text(), filename=str(path))


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def test_packages_import_only_the_layers_below_them():
    wrong = []
    for package, allowed in ALLOWED.items():
        for path, tree in _sources(package):
            for node in ast.walk(tree):
                for name in _imported(node):
                    top = name.split(".")[0]
                    if top in PACKAGES and top != package and top not in allowed:
                        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert wrong == []


def test_no_import_inside_a_function_outside_the_cli():
    inside = []
    for top in NO_FUNCTION_IMPORTS:
        for path, tree in _sources(top):
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    inside += [f"{path.relative_to(ROOT)}:{node.lineno} in {fn.name}()" for node in ast.walk(fn)
                               if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert inside == []


def test_the_rules_see_imports():
    """The checks above would pass vacuously if the walk found nothing: the executor imports the spec layer."""
    names = {name for _, tree in _sources("executor") for node in ast.walk(tree) for name in _imported(node)}
    assert "spec.model_spec" in names and "torch" in names


def test_nothing_but_scripts_imports_bench():
    """bench/ holds scripts: the packages never import it, and tests run its scripts as child processes
    (tests/bench/conftest.py) instead of importing them, so that no test depends on a script's insides."""
    importing = []
    for top in (*PACKAGES, "tests"):
        for path, tree in _sources(top):
            importing += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}" for node in ast.walk(tree)
                          for name in _imported(node) if name.split(".")[0] == "bench"]
    assert importing == []
