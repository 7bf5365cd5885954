"""The installed package: its version, metadata, extras and deprecated aliases.

These read the installed distribution's metadata (``importlib.metadata``), so
they check an editable install of this tree as well as a wheel or sdist
installed elsewhere (``scripts/release_check.sh`` runs them so, with this
tree's ``pyproject.toml`` beside the copied tests). The sdist's file list is
checked by the release check, which builds it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import warnings
from pathlib import Path

import pytest

import dedupcore
import dedupcore.factory
import dedupcore.stack

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"


def _requirements() -> list[tuple[str, str]]:
    """(distribution name, marker text) of each Requires-Dist line."""
    out = []
    for line in importlib.metadata.requires("dedupcore") or []:
        spec, _, marker = line.partition(";")
        name = re.match(r"[A-Za-z0-9._-]+", spec.strip())
        assert name is not None, line
        out.append((name.group(0).lower().replace("_", "-"), marker.strip()))
    return out


def test_the_version_is_the_installed_metadata() -> None:
    assert dedupcore.__version__ == importlib.metadata.version("dedupcore")
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc|\.dev|\.post)?\d*", dedupcore.__version__)


def test_the_version_is_written_once_in_pyproject() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert "version" not in project.get("dynamic", [])
    # An install older than the source would report the old version: reinstall.
    assert project["version"] == importlib.metadata.version("dedupcore")
    # The package reads it; it does not spell it out again.
    init = Path(dedupcore.__file__).read_text()
    for node in ast.walk(ast.parse(init)):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            assert not isinstance(node.value, ast.Constant), ast.unparse(node)


def test_redis_is_an_extra_not_a_dependency() -> None:
    requirements = _requirements()
    plain = {name for name, marker in requirements if "extra" not in marker}
    assert "redis" not in plain and "hiredis" not in plain
    assert plain >= {"lmdb", "msgpack"}

    def extra(name: str) -> set[str]:
        wanted = re.compile(rf"""extra\s*==\s*["']{name}["']""")
        return {dist for dist, marker in requirements if wanted.search(marker)}

    assert "redis" in extra("redis")
    assert {"hiredis", "dedupcore"} <= extra("hiredis")  # hiredis brings dedupcore[redis]
    assert "dedupcore" in extra("test")  # test pulls in dedupcore[...,redis,...]
    assert "redis" in importlib.metadata.metadata("dedupcore").get_all("Provides-Extra")


def test_the_metadata_names_the_licence_and_ships_its_text() -> None:
    meta = importlib.metadata.metadata("dedupcore")
    assert meta["License-Expression"] == "Apache-2.0"
    files = importlib.metadata.files("dedupcore") or []
    licences = [f for f in files if f.name == "LICENSE"]
    assert licences, "LICENSE is not in the installed distribution"
    text = licences[0].read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a pointer to it


def test_the_moved_open_store_warns_and_is_the_same_function() -> None:
    with pytest.warns(DeprecationWarning, match=r"dedupcore\.factory\.open_store") as caught:
        from dedupcore.stack import open_store as old
    assert old is dedupcore.factory.open_store is dedupcore.open_store
    assert "0.3.0" in str(caught[0].message)  # when the alias goes
    assert caught[0].filename == __file__  # the warning points at the caller's line

    with pytest.warns(DeprecationWarning, match="moved to dedupcore.factory"):
        assert dedupcore.stack.open_store is old


def test_names_still_in_the_stack_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dedupcore.stack.TieredStore is dedupcore.TieredStore
        from dedupcore.stack import ShardedStore  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'open_stor'"):
        dedupcore.stack.open_stor  # noqa: B018
