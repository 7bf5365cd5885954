"""Files of the embedded store: only the owner may list or read them.

A stored result is business data: another local user must not be able to read it,
nor the keys a consumer has seen. Every directory the store creates is 0700 and
every file 0600, whatever the umask allows.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dedupcore.store import DedupStore, Outcome

NS = "files/ns"


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and of everything under it, by relative path."""
    modes = {".": stat.S_IMODE(root.stat().st_mode)}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            modes[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return modes


def test_every_file_and_directory_the_store_creates_is_private(
    tmp_path: Path, umask_022: None
) -> None:
    path = tmp_path / "data"
    keys = [f"secret-{i}" for i in range(200)]
    with DedupStore.open(path, checkpoint_records=10**9, checkpoint_interval=1e9) as store:
        claims = store.claim_many(keys, namespace=NS)
        store.complete_many([(c.key, c.token, {"card": c.key}) for c in claims], namespace=NS)
        store.checkpoint()
        # Far in the future: the records expire and are demoted to the cold archive,
        # which writes its slice files.
        assert store.sweep(now=time.time() + 60 * 86400) > 0
        store.claim("held", namespace=NS, owner="w")
    with DedupStore.open(path) as store:
        assert store.claim("held", namespace=NS, owner="other").outcome is Outcome.IN_PROGRESS
    modes = _modes(path)
    names = set(modes)
    # What the check covers: the lock, LMDB, the log, the front filter, the cold archive.
    assert {".", "LOCK", "lmdb", "lmdb/data.mdb", "lmdb/lock.mdb", "wal", "front", "cold"} <= names
    assert any(n.startswith("wal/wal-") for n in names), names
    assert any(n.startswith("front/") and n.endswith(".bloom") for n in names), names
    assert any(n.startswith("cold/") and n.endswith(".bloom") for n in names), names
    wrong = {
        name: oct(mode)
        for name, mode in modes.items()
        if mode != (0o700 if (path / name).is_dir() else 0o600)
    }
    assert not wrong, f"readable by others (umask 022): {wrong}"
