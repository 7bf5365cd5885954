"""The default socket of a user other than root (docs/daemon-config.md, "The socket"):
``$XDG_RUNTIME_DIR/dedupcore/dedupcore.sock`` when XDG_RUNTIME_DIR is set, which
``serve``, ``stats``, ``Client()`` and ``aio.Client()`` all find; without it,
``/run/dedupcore/dedupcore.sock``, which such a user cannot create: ``serve`` then
says so, with the errno and the way out, and no traceback.

The daemon and the clients really run as ``nobody`` (setpriv, or a forked child
that drops to its uid), never as root pretending.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from dedupcore import aio
from dedupcore.client import DEFAULT_SOCKET, Client, default_socket
from tests.support.daemon import Daemon, Lab
from tests.support.procs import NOBODY, PATIENCE, ROOT, child_env, run_as, run_cli
from tests.support.stores import unique_ns

SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def nobody_env(runtime: Path | None) -> dict[str, str]:
    """A login-like environment of ``nobody``: no DEDUPCORE_SOCKET; XDG_RUNTIME_DIR
    when ``runtime`` is given."""
    env = child_env()
    env.pop("XDG_RUNTIME_DIR", None)
    env["HOME"] = "/nonexistent"
    if runtime is not None:
        env["XDG_RUNTIME_DIR"] = str(runtime)
    return env


def owned_by_nobody(path: Path, mode: int = 0o700) -> Path:
    path.mkdir()
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, mode)
    return path


def nobody_daemon(lab: Lab, home: Path, runtime: Path | None) -> Daemon:
    """``dedupcore serve`` run as nobody (through setpriv) with no --socket: it picks its
    default, where the returned daemon expects it.

    The test (root) may connect too (--allow-uid 0), so the launcher's readiness
    check works unchanged.
    """
    expected = runtime / "dedupcore" / "dedupcore.sock" if runtime else Path(DEFAULT_SOCKET)
    daemon = Daemon(
        home, home / "data", expected, ["--allow-uid", "0"], prefix=SETPRIV, socket_arg=False
    )
    lab.daemons.append(daemon)
    return daemon.start()


def nobody_home(lab: Lab) -> Path:
    home = lab.tmpdir()
    os.chmod(home, 0o711)  # nobody may pass through to its own directories below
    owned_by_nobody(home / "data")
    return home


def test_the_default_for_root_and_for_other_users() -> None:
    env = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    assert os.geteuid() == 0  # these tests run as root, as CI does
    assert default_socket(env) == DEFAULT_SOCKET  # root: the system path, whatever XDG says
    assert default_socket({**env, "DEDUPCORE_SOCKET": "/tmp/x.sock"}) == "/tmp/x.sock"

    def as_nobody() -> str:
        return "|".join(
            [
                default_socket(env),
                default_socket({"XDG_RUNTIME_DIR": "relative/dir"}),
                default_socket({}),
                default_socket({**env, "DEDUPCORE_SOCKET": "/tmp/x.sock"}),
            ]
        )

    assert run_as(NOBODY, NOBODY, as_nobody).split("|") == [
        "/run/user/1000/dedupcore/dedupcore.sock",
        DEFAULT_SOCKET,
        DEFAULT_SOCKET,
        "/tmp/x.sock",
    ]


def test_a_user_serves_and_is_found_in_its_runtime_directory(
    lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = nobody_home(lab)
    runtime = owned_by_nobody(home / "run")
    for name, value in nobody_env(runtime).items():  # what the launcher passes on
        monkeypatch.setenv(name, value)
    nobody_daemon(lab, home, runtime)
    sock = runtime / "dedupcore" / "dedupcore.sock"
    assert sock.is_socket() and os.stat(sock).st_uid == NOBODY
    assert os.stat(sock.parent).st_uid == NOBODY
    ns = unique_ns("user")

    def clients() -> str:
        os.environ.pop("DEDUPCORE_SOCKET", None)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
        with Client(timeout=PATIENCE, retries=1) as c:
            first = c.claim("k", namespace=ns).outcome.value
            path = c.path

        async def again() -> str:
            async with aio.Client(timeout=PATIENCE, retries=1) as a:
                return (await a.claim("k", namespace=ns)).outcome.value

        return f"{path} {first} {asyncio.run(again())}"

    assert run_as(NOBODY, NOBODY, clients) == f"{sock} new in_progress"
    stats = run_cli(
        "stats", "--json", "--interval", "0", prefix=SETPRIV, env=nobody_env(runtime), cwd=ROOT
    )
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["namespaces"][ns]["new"] == 1


def test_a_user_without_a_runtime_directory_is_told_what_to_do(lab: Lab) -> None:
    system_dir = Path(DEFAULT_SOCKET).parent
    there = system_dir.exists()  # made by a root daemon on the default path, or not
    home = nobody_home(lab)
    out = run_cli(
        "serve", "--data", str(home / "data"), prefix=SETPRIV, env=nobody_env(None), cwd=home
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dedupcore serve: cannot serve the socket {DEFAULT_SOCKET}: "), last
    if there:  # root's directory, which this user may not use
        assert f"{system_dir} belongs to uid 0, not to this user" in last, last
    else:  # this user may not create it: the errno is named
        assert f"{system_dir}: Permission denied (errno 13, EACCES)" in last, last
        assert not system_dir.exists()
    assert "XDG_RUNTIME_DIR" in last, last
    assert "`dedupcore serve --socket PATH` or DEDUPCORE_SOCKET=PATH" in last, last
