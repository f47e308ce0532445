"""Every ``foldtune ...`` command in the code blocks of README.md and docs/*.md, as argument lists.

The docs abbreviate: ``foldtune plan ... --explain "tp2 pp8 ep8 mbs1"`` means the arguments of the last full
``foldtune plan`` command above it in the same file, then ``--explain ...``. A backslash continues a line, ``#``
starts a comment, and a command ends at ``&&``, ``||``, ``;``, ``|`` or ``&`` (the shell's meaning).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_OPERATORS = {"&&", "||", ";", "|", "&", ";;"}  # "(" stays a word: "(foldtune ...)" in a diagram is no command
ABBREVIATION = "..."


@dataclass(frozen=True)
class DocCommand:
    """One command of a doc: where it is, its text there and its arguments after ``foldtune``."""

    path: Path
    line: int
    text: str
    argv: tuple[str, ...]

    @property
    def command(self) -> str:
        return self.argv[0] if self.argv else ""

    @property
    def where(self) -> str:
        shown = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{shown}:{self.line}"


def _shell_lines(block: str, first_line: int) -> list[tuple[int, str]]:
    """The block's logical lines (backslash continuations joined), each with its line number in the file."""
    out, pending, start = [], "", first_line
    for i, raw in enumerate(block.splitlines()):
        if not pending:
            start = first_line + i
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        out.append((start, pending + raw))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def _segments(line: str) -> list[list[str]]:
    """The simple commands of one shell line, as words; comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[list[str]] = [[]]
    for token in lexer:
        if token in _OPERATORS:
            words.append([])
        else:
            words[-1].append(token)
    return [w for w in words if w]


def commands_in(path: Path) -> list[DocCommand]:
    """The ``foldtune`` commands of ``path``'s fenced code blocks, ``...`` expanded (see the module docstring)."""
    text = path.read_text()
    found: list[DocCommand] = []
    full: dict[str, tuple[str, ...]] = {}  # command name -> the arguments of its last full command
    for block in _FENCE.finditer(text):
        first_line = text.count("\n", 0, block.start(1)) + 1
        for number, line in _shell_lines(block.group(1), first_line):
            try:
                segments = _segments(line)
            except ValueError:  # not shell (an unbalanced quote in a diagram or a config file)
                continue
            for words in segments:
                if words[0] != "foldtune":
                    continue
                argv = tuple(words[1:])
                if len(argv) >= 2 and argv[1] == ABBREVIATION:
                    base = full.get(argv[0])
                    if base is None:
                        raise ValueError(f"{path.name}:{number}: 'foldtune {argv[0]} ...' with no full "
                                         f"'foldtune {argv[0]}' command above it")
                    argv = base + argv[2:]
                elif argv:
                    full[argv[0]] = argv
                found.append(DocCommand(path, number, line.strip(), argv))
    return found


def doc_commands() -> list[DocCommand]:
    """Every documented ``foldtune`` command, README first, then docs/*.md by name."""
    return [c for path in DOC_FILES for c in commands_in(path)]
