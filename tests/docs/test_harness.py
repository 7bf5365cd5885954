"""The docs harness itself: a wrong block must fail, whatever its language."""

from __future__ import annotations

import unittest
from pathlib import Path
from typing import Any

import pytest
from sybil import Document

from dedupcore.cli.config import SettingsError
from tests.docs.conftest import _DOCS, DOCUMENTS, ROOT, ShellBlockParser


def examples(tmp_path: Path, text: str) -> list[Any]:
    """The examples of a Markdown document, with the namespace the harness gives."""
    path = tmp_path / "page.md"
    path.write_text(text)
    document: Document = _DOCS.parse(path)
    document.namespace["_docs"] = {"home": str(tmp_path), "environ": {"GREETING": "hello"}}
    return list(document.examples())


def test_every_page_is_collected() -> None:
    assert ROOT / "README.md" in DOCUMENTS
    assert {"performance.md", "stores.md", "quickstart.md"} <= {p.name for p in DOCUMENTS}
    assert all(_DOCS.should_parse(p) for p in DOCUMENTS)


def test_a_setting_that_does_not_exist_fails(tmp_path: Path) -> None:
    good, bad = examples(
        tmp_path,
        '```toml\nlease = "45s"\n[retention]\nexact_window = "7d"\n```\n\n'
        '```toml\nlease = "45s"\nno_such_setting = 1\n```\n',
    )
    good.evaluate()
    with pytest.raises(SettingsError, match="no_such_setting"):
        bad.evaluate()


def test_a_bad_value_fails(tmp_path: Path) -> None:
    (block,) = examples(tmp_path, '```toml\n[retention]\nexact_window = "-1d"\n```\n')
    with pytest.raises(SettingsError, match="exact_window"):
        block.evaluate()


def test_a_failing_command_fails(tmp_path: Path) -> None:
    ok, failing, piped = examples(
        tmp_path,
        '```bash\ntest "$GREETING" = hello && touch made-here\n```\n\n'
        "```bash\ntrue\nfalse\ntrue\n```\n\n"
        "```sh\nfalse | cat\n```\n",
    )
    ok.evaluate()
    assert (tmp_path / "made-here").exists()  # run in the document's directory
    with pytest.raises(Exception, match="exit status 1"):
        failing.evaluate()
    with pytest.raises(Exception, match="exit status 1"):
        piped.evaluate()


def test_console_blocks_run_their_commands(tmp_path: Path) -> None:
    (block,) = examples(tmp_path, "```console\n$ false\noutput\n```\n")
    assert ShellBlockParser("console").script("$ echo 1\n1\n$ echo 2\n") == "echo 1\necho 2"
    with pytest.raises(Exception, match="exit status 1"):
        block.evaluate()


def test_broken_json_and_yaml_fail(tmp_path: Path) -> None:
    json_block, yaml_block = examples(tmp_path, '```json\n{"a": \n```\n\n```yaml\na: [1\n```\n')
    with pytest.raises(ValueError):
        json_block.evaluate()
    with pytest.raises(Exception, match="expected"):
        yaml_block.evaluate()


def test_a_skip_needs_no_server(tmp_path: Path) -> None:
    blocks = examples(
        tmp_path, '<!-- skip: next "a server that runs until stopped" -->\n\n```bash\nfalse\n```\n'
    )
    with pytest.raises(unittest.SkipTest, match="runs until stopped"):
        for block in blocks:
            block.evaluate()
