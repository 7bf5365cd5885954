"""systemd socket activation: ``dedupcore serve`` takes a listening socket passed as
descriptor 3 (``LISTEN_PID``/``LISTEN_FDS``), done here as systemd does it.

The test binds and listens, then starts the daemon through a small wrapper that
puts the socket on descriptor 3 and sets ``LISTEN_PID`` to its own pid before
it ``exec``s the daemon (so the pid is the daemon's). Like systemd, the test keeps
its listening socket open across daemon restarts.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dedupcore.api import Outcome
from dedupcore.client import Client
from dedupcore.daemon.server import DaemonServer, inherited_socket
from tests.support.daemon import Daemon, Lab, ping_from_child
from tests.support.procs import NOBODY, PATIENCE, child_env, run_as
from tests.support.stores import unique_ns

#: What systemd does before it runs the service: the socket on descriptor 3, LISTEN_PID
#: the pid of the process that execs the service, LISTEN_FDS the number of sockets.
WRAPPER = """
import os, sys
source, listen_pid, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
fd = os.open(os.devnull, os.O_RDONLY) if source == "devnull" else int(source)
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid()) if listen_pid == "self" else listen_pid
os.environ["LISTEN_FDS"] = "1"
os.execv(argv[0], argv)
"""


class Activation:
    """A listening socket as systemd would make it, and daemons started on it."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.home = lab.tmpdir()
        # Reachable by another uid, so only the daemon's SO_PEERCRED check can refuse it.
        os.chmod(self.home, 0o711)
        (self.home / "run").mkdir(mode=0o755)
        self.path = self.home / "run" / "dedupcore.sock"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        os.chmod(self.path, 0o666)
        self.listener.listen(64)
        #: A --socket path of its own, for a daemon that is not activated.
        self.unused = self.home / "unused" / "d.sock"

    def wrapper(self, listen_pid: str = "self", fd3: int | str | None = None) -> list[str]:
        """The command that puts ``fd3`` (default: the listener) on descriptor 3 and sets
        LISTEN_PID before it execs the daemon (``"devnull"``: a file, not a socket)."""
        source = self.listener.fileno() if fd3 is None else fd3
        return [sys.executable, "-c", WRAPPER, str(source), listen_pid]

    def command(
        self, socket_path: Path, listen_pid: str = "self", fd3: int | str | None = None
    ) -> list[str]:
        """``dedupcore serve --socket socket_path`` through the wrapper."""
        daemon = Daemon(
            self.home,
            self.home / "data",
            socket_path,
            ["--log-level", "DEBUG"],
            prefix=self.wrapper(listen_pid, fd3),
        )
        return daemon.command()

    def start(self, *, socket_path: Path, listen_pid: str = "self") -> Daemon:
        """A daemon started through the wrapper with ``--socket socket_path``."""
        return self.lab.daemon(
            "--log-level",
            "DEBUG",
            data=self.home / "data",
            socket=socket_path,
            prefix=self.wrapper(listen_pid),
            pass_fds=(self.listener.fileno(),),
        )

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def activation(lab: Lab) -> Iterator[Activation]:
    a = Activation(lab)
    try:
        yield a
    finally:
        a.close()


def test_serves_the_inherited_socket_and_leaves_it_for_the_next_start(
    activation: Activation,
) -> None:
    a = activation
    ns = unique_ns("activated")
    daemon = a.start(socket_path=a.path)
    with Client(a.path, timeout=PATIENCE) as c:
        claim = c.claim("order-1", namespace=ns)
        assert claim.outcome is Outcome.NEW
        c.complete("order-1", claim.token, namespace=ns, result=b"done")
    assert daemon.stop() == 0, daemon.log_text()
    assert "LISTEN_FDS" in daemon.log_text()
    # The path it was given is the one passed (as systemd's ListenStream= and
    # --socket name the same file): it was served as passed, not bound (a bind
    # would find it live and refuse), and it is not removed on exit.
    assert a.path.is_socket()
    # The service manager starts it again on the same socket: the key is remembered.
    again = a.start(socket_path=a.path)
    with Client(a.path, timeout=PATIENCE) as c:
        dup = c.claim("order-1", namespace=ns)
        assert dup.outcome is Outcome.DUPLICATE and dup.result == b"done"
    assert again.stop() == 0, again.log_text()
    assert a.path.is_socket()


def test_peer_credentials_are_still_checked_on_an_inherited_socket(
    activation: Activation,
) -> None:
    a = activation
    daemon = a.start(socket_path=a.path)
    report = run_as(NOBODY, NOBODY, ping_from_child(a.path))
    assert report.startswith("UnavailableError"), report
    assert f"uid {NOBODY}" in daemon.log_text()
    with Client(a.path, timeout=PATIENCE) as c:
        assert c.stats()["daemon"]["refused_connections"] >= 1


def test_a_listen_pid_of_another_process_is_ignored(activation: Activation) -> None:
    """LISTEN_PID of the wrapper's parent: not for this process, so it binds --socket."""
    a = activation
    daemon = a.start(socket_path=a.unused, listen_pid=str(os.getpid()))
    assert a.unused.is_socket()
    with Client(a.unused, timeout=PATIENCE) as c:
        assert c.claim("k", namespace=unique_ns()).outcome is Outcome.NEW
    assert daemon.stop() == 0, daemon.log_text()
    assert not a.unused.exists()  # a socket it bound itself is removed on exit
    assert "LISTEN_FDS" not in daemon.log_text()


def refusal(a: Activation, fd3: int | str) -> str:
    """Runs the wrapper with ``fd3`` on descriptor 3, which must refuse it: its stderr."""
    fds = (a.listener.fileno(), *((fd3,) if isinstance(fd3, int) else ()))
    proc = subprocess.run(
        a.command(a.path, fd3=fd3),
        pass_fds=fds,
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=a.home,
        timeout=PATIENCE,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_a_descriptor_3_that_is_not_a_listening_socket_is_refused(
    activation: Activation,
) -> None:
    a = activation
    assert "descriptor 3 is not a socket" in refusal(a, "devnull")
    # A socket that is not listening (bound, never listen()ed) is refused too.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.bind(str(a.home / "run" / "idle.sock"))
        assert "not a listening Unix stream socket" in refusal(a, idle.fileno())
    assert not (a.home / "data").exists()


@pytest.mark.parametrize(
    "env",
    [
        {"LISTEN_PID": "1", "LISTEN_FDS": "1"},
        {"LISTEN_PID": "self", "LISTEN_FDS": "0"},
        {"LISTEN_PID": "self", "LISTEN_FDS": "x"},
        {"LISTEN_PID": "", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "dedupcore.socket"},
        {"LISTEN_FDS": "1"},
    ],
)
def test_variables_not_for_this_process_are_ignored_and_removed(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, str(os.getpid()) if value == "self" else value)
    assert inherited_socket() is None
    assert not {"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"} & set(os.environ)


def test_a_passed_socket_must_be_a_socket(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"sock must be a listening socket\.socket, not int"):
        DaemonServer(object(), tmp_path / "d.sock", sock=3)  # type: ignore[arg-type]
