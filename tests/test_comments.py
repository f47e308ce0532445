"""Product code's comments and docstrings say why, not when: no issue numbers, dates, clock times, commit hashes
or run-by-run history. Measurement history lives in docs/benchmarks.md and commit messages (README house rules).
A comment that breaks the rule fails here with its file:line and the words that matched."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spec", "costmodel", "planner", "executor", "db", "api")

_HASH = r"`?(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b`?"
# (name, pattern) pairs, each meant to be tight: it names a kind of history, not a word prose needs.
HISTORY = (
    # 'issue 19', 'issues 16, 19', 'issue #12', 'bench/results/issue16/...', '(#12)', 'PR #3', 'gh-42'
    ("issue reference", re.compile(r"(?i)\bissues?[ _-]?#?\d+|\(#\d+\)|\bPR ?#\d+|\bgh-\d+\b")),
    # an ISO calendar date: 2026-11-27 (also inside 2026-11-27T05:00)
    ("date", re.compile(r"(?<![\d-])20\d\d-[01]\d-[0-3]\d(?![\d-])")),
    # a clock time, '05:00 UTC' or a table's '(08:19)'
    ("clock time", re.compile(r"(?<![\d:])[0-2]\d:[0-5]\d(?::[0-5]\d)?(?![\d:])")),
    # a commit of this repository: 'at commit abc1234', 'code 3448e84', 'at 9582f22', 'main 9fb34c0', 'fixed in
    # 6e17de1'; another project's pinned version ('commit d98e8a6 of NVIDIA/Megatron-LM') is a source, not history
    ("commit hash", re.compile(r"(?i)\b(?:commit|code|at|main|since|until|before|after|in)\s+" + _HASH
                               + r"(?!\s+of\s+[\w.-]+/)")),
    # narrative of earlier runs: 'until then', 'the third session', 'on the next run', 'was 1.05 before'
    ("run history", re.compile(r"(?i)\buntil then\b|\b(?:first|second|third|fourth|fifth|sixth|last|previous)"
                               r" session\b|\bon the next run\b|\bwas [\d.]+ ?\S* before\b")),
)


def history_in(text: str) -> list[str]:
    """What in ``text`` reads as history: 'kind: matched words', in order of the patterns."""
    return [f"{name}: {m.group(0)!r}" for name, pattern in HISTORY for m in pattern.finditer(text)]


def _exempt(path: Path, line: str) -> bool:
    # Alembic's generated revision header records when the revision file was made (its own format)
    return "migrations" in path.parts and line.lstrip().startswith("Create Date:")


def _comment_lines(path: Path, source: str):
    """(line number, text) of every comment and every string statement (docstrings and ``#:``-style
    attribute docstrings alike) of one module, a string's lines one by one."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            # the literal's own source lines, so that line numbers hold for implicit concatenation too
            lines = source.splitlines()[node.lineno - 1:node.end_lineno]
            for offset, line in enumerate(lines):
                yield node.lineno + offset, line


def history_lines(paths, root: Path = ROOT) -> list[str]:
    """'file:line: kind: words' (file relative to ``root``) for every comment or docstring line of ``paths``
    that carries history."""
    found = []
    for path in paths:
        source = path.read_text()
        for lineno, text in sorted(set(_comment_lines(path, source))):
            if _exempt(path, text):
                continue
            for hit in history_in(text):
                found.append(f"{path.relative_to(root)}:{lineno}: {hit}")
    return found


def _product_sources():
    for top in PACKAGES:
        yield from sorted((ROOT / top).rglob("*.py"))


def test_product_comments_carry_no_measurement_history():
    found = history_lines(_product_sources())
    assert not found, ("comments and docstrings say why; move dates, issue numbers and commits to "
                       "docs/benchmarks.md or the commit message:\n" + "\n".join(found))


def test_patterns_catch_history():
    for text in ("# torch's add ran at half the HBM rate (issue 19).", "see issues 16, 19",
                 "bench/results/issue16/h200-0457/cp_dispatch.json", "the fix (#12)", "PR #3",
                 "(H100, 2026-11-27)", "docs/benchmarks.md, 08:19 UTC", 'under "Executor (08:19)"',
                 "code 3448e84", "at commit abc1234", "measured at 9582f22", "(Until then it priced 0.693.)",
                 "after the third session", "the factor was 1.05 before the change"):
        assert history_in(text), text


def test_patterns_leave_reasons_alone():
    for text in ("# the issue is that NCCL's kernels hold SMs", "measured_at (UTC ISO)",
                 "timezone-aware UTC on the Python side", "read, not copied, at commit d98e8a6 of NVIDIA/Megatron-LM",
                 "NeMo 24.07 fp8 H100 dense rows", "Korthikanti 2022 A100", "1.55 x 755 = 1170 of 1979 TFLOP/s",
                 "ratio 3:1", "one call each: 12 exchanges", "0x4 (software power cap)", "at 1000000 elements",
                 "in deadbeef", "issued at the next micro-batch", "the session's rows", "2 x H200: 0.14 ms"):
        assert not history_in(text), (text, history_in(text))


def test_a_planted_comment_is_named_by_file_and_line(tmp_path):
    planted = tmp_path / "spec" / "planted.py"
    planted.parent.mkdir()
    planted.write_text('"""A module, timed at commit 5cb7b49."""\n\nX = 1  # measured on 2026-11-27 (issue 19)\n'
                       'Y = "2026-11-27"  # a date in code is data, not a comment\n')
    assert history_lines([planted], root=tmp_path) == [
        "spec/planted.py:1: commit hash: 'commit 5cb7b49'",
        "spec/planted.py:3: issue reference: 'issue 19'",
        "spec/planted.py:3: date: '2026-11-27'"]
