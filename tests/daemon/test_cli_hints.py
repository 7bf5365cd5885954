"""Every ``dedupcore ...`` command line that the package's messages suggest parses with
the real command-line parser, so a hint never names a subcommand or flag that does not
exist."""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator

import pytest

from dedupcore.cli import _parser
from tests.support.procs import ROOT

PACKAGE = ROOT / "dedupcore"
#: A command line quoted in a message: `dedupcore serve --data ...`.
QUOTED = re.compile(r"`dedupcore ([^`]+)`")
#: What a hint writes where the user puts a value of their own.
PLACEHOLDER = "VALUE"


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string nodes that are docstrings (not messages)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _text(node: ast.AST) -> str | None:
    """A string literal's text; an f-string's with each replacement field as a value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else PLACEHOLDER for v in node.values)
    return None


def suggested_command_lines() -> Iterator[tuple[str, str]]:
    """(where, command line) of each quoted ``dedupcore ...`` in the package's strings."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        skip = _docstrings(tree)
        inner: set[int] = set()  # the literal parts of f-strings, read with their f-string
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                inner.update(id(v) for v in node.values)
        for node in ast.walk(tree):
            if id(node) in skip or id(node) in inner:
                continue
            text = _text(node)
            if text is None:
                continue
            for m in QUOTED.finditer(text):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
                yield where, m.group(1)


HINTS = list(suggested_command_lines())


def test_the_hints_are_found() -> None:
    # The data-directory hint of a format-1 directory opened read-only is one of them.
    assert any(w.startswith("dedupcore/migrate.py") for w, _ in HINTS), HINTS
    assert any(w.startswith("dedupcore/sql/") for w, _ in HINTS), HINTS


def _parses(argv: list[str]) -> bool:
    try:
        _parser().parse_args(argv)
    except SystemExit:
        return False
    return True


@pytest.mark.parametrize(("where", "line"), HINTS, ids=[f"{w} {c}" for w, c in HINTS])
def test_every_suggested_command_line_parses(where: str, line: str) -> None:
    argv = [PLACEHOLDER if word == "..." else word for word in shlex.split(line)]
    # A hint may name an option without its value ("the directory `dedupcore serve
    # --data` uses"): the option must exist all the same.
    assert _parses(argv) or _parses([*argv, PLACEHOLDER]), (
        f"{where}: `dedupcore {line}` is not a valid command line"
    )
