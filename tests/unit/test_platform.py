"""What differs between platforms (dedupcore/_platform.py, docs/compatibility.md).

Linux is the tested platform; the fallbacks for others are checked here by
replacing what the platform offers (``os.fdatasync``, ``fcntl.F_FULLFSYNC``,
``socket.SO_PEERCRED``, ``sys.platform``) and recording which call is made.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from pathlib import Path

import pytest

import dedupcore._platform as _platform
from dedupcore.daemon.server import DaemonServer
from dedupcore.errors import DedupError, UnsupportedPlatformError
from dedupcore.store import DedupStore
from dedupcore.wal import WriteAheadLog


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Records os.fdatasync, os.fsync and fcntl.fcntl calls (still making the real ones
    that exist here)."""
    made: list[tuple[str, int]] = []
    real_fsync = os.fsync

    def fdatasync(fd: int) -> None:
        made.append(("fdatasync", fd))

    def fsync(fd: int) -> None:
        made.append(("fsync", fd))
        real_fsync(fd)

    def fake_fcntl(fd: int, cmd: int, *args: object) -> int:
        made.append((f"fcntl {cmd}", fd))
        return 0

    monkeypatch.setattr(os, "fdatasync", fdatasync, raising=False)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(fcntl, "fcntl", fake_fcntl)
    return made


def test_fdatasync_where_the_platform_has_it(tmp_path: Path, calls: list[tuple[str, int]]) -> None:
    with open(tmp_path / "f", "wb") as fh:
        _platform.fdatasync(fh.fileno())
        assert calls == [("fdatasync", fh.fileno())]


def test_fsync_where_there_is_no_fdatasync(
    tmp_path: Path, calls: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "fdatasync")
    with open(tmp_path / "f", "wb") as fh:
        _platform.fdatasync(fh.fileno())
        assert calls == [("fsync", fh.fileno())]


def test_full_fsync_on_macos(
    tmp_path: Path, calls: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", 51, raising=False)  # macOS's value
    with open(tmp_path / "f", "wb") as fh:
        _platform.fdatasync(fh.fileno())
        # fdatasync (where a Python has it there) and fsync leave data in the drive's cache
        assert calls == [("fcntl 51", fh.fileno())]


def test_the_write_ahead_log_flushes_through_the_platform_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushed: list[int] = []
    real = _platform.fdatasync

    def counting(fd: int) -> None:
        flushed.append(fd)
        real(fd)

    monkeypatch.setattr(_platform, "fdatasync", counting)
    with WriteAheadLog.open(tmp_path) as wal:
        wal.write([b"a"])
        wal.sync()
        assert len(flushed) == 1


def test_peer_credentials_on_linux() -> None:
    assert sys.platform.startswith("linux")  # the platform the suite runs on
    assert _platform.peer_credentials_option() == socket.SO_PEERCRED


@pytest.mark.parametrize("platform", ["darwin", "freebsd14", "openbsd7"])
def test_peer_credentials_elsewhere_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, platform: str
) -> None:
    monkeypatch.setattr(sys, "platform", platform)
    with pytest.raises(UnsupportedPlatformError, match=f"SO_PEERCRED.*{platform}.*Linux"):
        _platform.peer_credentials_option()


def test_peer_credentials_without_the_option_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(socket, "SO_PEERCRED", raising=False)
    with pytest.raises(UnsupportedPlatformError, match="SO_PEERCRED"):
        _platform.peer_credentials_option()


def test_the_daemon_refuses_to_start_without_peer_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert issubclass(UnsupportedPlatformError, DedupError)
    assert issubclass(UnsupportedPlatformError, OSError)
    monkeypatch.delattr(socket, "SO_PEERCRED", raising=False)
    with (
        DedupStore.open(tmp_path / "data") as store,
        pytest.raises(UnsupportedPlatformError, match="SO_PEERCRED"),
    ):
        DaemonServer(store, tmp_path / "d.sock")
    assert not (tmp_path / "d.sock").exists()


def test_trim_heap_returns_the_free_heap_where_the_c_library_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(_platform, "_malloc_trim", lambda: lambda pad: calls.append(pad) or 1)
    assert _platform.trim_heap() is True and calls == [0]
    monkeypatch.setattr(_platform, "_malloc_trim", lambda: lambda pad: 0)
    assert _platform.trim_heap() is False  # nothing to return
    monkeypatch.setattr(_platform, "_malloc_trim", lambda: None)
    assert _platform.trim_heap() is False  # no such call on this platform


def test_trim_heap_finds_malloc_trim_in_glibc() -> None:
    import platform

    if platform.libc_ver()[0] == "glibc":
        assert _platform._malloc_trim() is not None
    assert isinstance(_platform.trim_heap(), bool)
