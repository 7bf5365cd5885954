"""The one daemon launcher of the tests, and the client processes that talk to it.

A :class:`Daemon` lives in a short temporary directory of its own (``/tmp/dcXXXX``):
a Unix socket path must stay under 108 bytes, which pytest's ``tmp_path`` does not
guarantee. It has two faces:

- a ``dedupcore serve`` subprocess (:meth:`Daemon.start`), restartable on the same
  data and socket, optionally started through a wrapper command (``prefix``: another
  user, a resource limit, an inherited socket);
- a :class:`~dedupcore.daemon.server.DaemonServer` in this process on a loop thread of
  its own (:meth:`Daemon.serve`, or :func:`serving`), for stores the test builds itself
  (an instrumented store, a stack, shards).

A :class:`Lab` makes directories, daemons and ``tests/daemon/child.py`` processes and
stops them all in the fixture's teardown, whatever the test did to them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.client import Client
from dedupcore.errors import DedupError
from tests.support.procs import PATIENCE, ROOT, LineProcess, child_env, wait_until
from tests.support.stores import unique_ns

#: The client process of tests/daemon (JSON config in argv, commands on stdin).
CHILD = ROOT / "tests" / "daemon" / "child.py"


class Daemon:
    """One daemon on ``socket`` over ``data``: a subprocess, or a server in this process."""

    def __init__(
        self,
        home: Path,
        data: Path,
        socket: Path,
        args: Sequence[str] = (),
        *,
        prefix: Sequence[str] = (),
        socket_arg: bool = True,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.home = home
        self.data = data
        self.socket = socket
        self.args = list(args)
        #: A command the daemon is started through (it ends by exec-ing the rest).
        self.prefix = list(prefix)
        #: False: no --socket, the daemon picks its default (``socket`` is where it will be).
        self.socket_arg = socket_arg
        self.pass_fds = tuple(pass_fds)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = home / "daemon.log"
        self.runs = 0
        # The in-process face.
        self.server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._store: Any = None

    # -- the subprocess --------------------------------------------------------------------

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        serve = [sys.executable, "-m", "dedupcore", "serve", "--data", str(self.data)]
        if self.socket_arg:
            serve += ["--socket", str(self.socket)]
        return [*self.prefix, *serve, *self.args]

    def start(self, *, wait: bool = True) -> Daemon:
        self.runs += 1
        with open(self.log, "ab") as fh:
            fh.write(f"---- run {self.runs}\n".encode())
            self.proc = subprocess.Popen(
                self.command(),
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=child_env(),
                cwd=self.home,
                pass_fds=self.pass_fds,
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = PATIENCE) -> None:
        """Waits until the socket answers a ping; fails if the daemon exits first."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            rc = self.proc.poll()
            if rc is not None:
                raise AssertionError(f"daemon exited with {rc} before serving:\n{self.log_text()}")
            try:
                with Client(self.socket, timeout=10.0, retries=0) as c:
                    if c.ping():
                        return
            except (DedupError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"daemon did not answer within {timeout} s:\n{self.log_text()}"
                )
            time.sleep(0.05)

    def client(self, **options: Any) -> Client:
        return Client(self.socket, **options)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = PATIENCE) -> int:
        """SIGTERM, then the exit code (SIGKILL if it does not exit in time)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"daemon ignored SIGTERM for {timeout} s:\n{self.log_text()}"
            ) from None

    def kill(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    # -- the server in this process ----------------------------------------------------------

    def serve(self, store: Any, **options: Any) -> Any:
        """Serves ``store`` from this process (a DaemonServer with ``options`` on a loop
        thread) until :meth:`close`, which closes the store too; returns the server."""
        from dedupcore.daemon.server import DaemonServer

        self._store = store
        self.server = DaemonServer(store, self.socket, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self.server.serve_forever(),)
        )
        self._thread.start()
        thread = self._thread
        # Listening, not only bound: the socket's file exists from the bind on, and a
        # client connecting before the listen is refused.
        wait_until(lambda: self.server.listening or not thread.is_alive(), "the daemon listening")
        assert self.server.listening, "the daemon stopped before it listened"
        return self.server

    def _stop_serving(self) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self.server.stop)
        self._thread.join(PATIENCE)
        self._loop.close()
        self._loop = self._thread = None
        self._store.close()

    # -- both ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops whichever face runs (the subprocess: SIGCONT, SIGTERM, then SIGKILL)."""
        if self._thread is not None:
            self._stop_serving()
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def short_tmpdir() -> Path:
    """A fresh directory with a short path (``/tmp/dcXXXX``), for sockets."""
    return Path(tempfile.mkdtemp(prefix="dc", dir="/tmp"))


@contextlib.contextmanager
def serving(store: Any, **options: Any) -> Iterator[tuple[Any, Path]]:
    """``store`` served from this process: (the DaemonServer, its socket path). Stops it,
    closes the store and removes the socket's directory afterwards."""
    home = short_tmpdir()
    daemon = Daemon(home, home / "data", home / "d.sock")
    try:
        server = daemon.serve(store, **options)
        yield server, daemon.socket
    finally:
        daemon.close()
        shutil.rmtree(home, ignore_errors=True)


class ChildProc(LineProcess):
    """A ``tests/daemon/child.py`` process: JSON config in argv, commands on stdin, lines
    on stdout."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        super().__init__(
            [sys.executable, str(CHILD), json.dumps(config)],
            stdin=True,
            name=f"child {config.get('mode')}",
        )


class Lab:
    """Makes short temporary directories, daemons and child processes; cleans all up."""

    def __init__(self) -> None:
        self.dirs: list[Path] = []
        self.daemons: list[Daemon] = []
        self.children: list[ChildProc] = []

    def tmpdir(self) -> Path:
        d = short_tmpdir()
        self.dirs.append(d)
        return d

    def daemon(
        self,
        *args: str,
        data: Path | None = None,
        socket: Path | None = None,
        start: bool = True,
        **launch: Any,
    ) -> Daemon:
        """A daemon in a fresh directory (``data``/``socket`` override the defaults;
        ``launch``: ``prefix``, ``socket_arg``, ``pass_fds`` of :class:`Daemon`)."""
        home = self.tmpdir()
        d = Daemon(home, data or home / "data", socket or home / "s" / "d.sock", args, **launch)
        self.daemons.append(d)
        if start:
            d.start()
        return d

    def configured(self, **settings: Any) -> Daemon:
        """A daemon started with these ``serve`` settings (through a TOML file: the
        limits without a command-line option, docs/daemon-config.md)."""
        config = self.tmpdir() / "serve.toml"
        config.write_text("".join(f"{k} = {v!r}\n" for k, v in settings.items()))
        return self.daemon("--config", str(config))

    def serve_expecting_refusal(self, *args: str, timeout: float = PATIENCE) -> tuple[int, str]:
        """Runs ``dedupcore serve ARGS`` that should refuse to start: (exit code, output)."""
        home = self.tmpdir()
        cmd = [sys.executable, "-m", "dedupcore", "serve", *args]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env(),
            cwd=home,
            text=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            raise AssertionError(
                f"`{' '.join(args)}` kept running instead of refusing:\n{out}"
            ) from None
        return proc.returncode, out

    def child(self, **config: Any) -> ChildProc:
        c = ChildProc(config)
        self.children.append(c)
        return c

    def close(self) -> None:
        for c in self.children:
            c.close()
        for d in self.daemons:
            d.close()
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)


def refused(lab: Lab, *args: str) -> str:
    """The output of ``dedupcore serve ARGS``, which must refuse to start, without a traceback."""
    rc, out = lab.serve_expecting_refusal(*args)
    assert rc != 0, out
    assert "Traceback" not in out, out
    return out


def serve_args(*argv: str) -> argparse.Namespace:
    """The parsed ``dedupcore serve ARGV``, as the command gives it to the settings."""
    from dedupcore.cli import _parser

    return _parser().parse_args(["serve", *argv])


# -- talking to a daemon ------------------------------------------------------------------------

#: The length prefix of every frame of the protocol.
HEADER = struct.Struct(">I")


def assert_serves(daemon: Daemon) -> None:
    """A fresh client (in a fresh thread, so on a fresh connection) is answered."""
    failures: list[BaseException] = []

    def check() -> None:
        try:
            with Client(daemon.socket, timeout=PATIENCE) as c:
                assert c.ping()
                ns = unique_ns("ok")
                claim = c.claim("k", namespace=ns)
                assert claim.outcome is Outcome.NEW
                c.complete("k", claim.token, namespace=ns, result=b"r")
                assert c.claim("k", namespace=ns).result == b"r"
        except BaseException as exc:
            failures.append(exc)

    t = threading.Thread(target=check)
    t.start()
    t.join()
    assert not failures, failures


def open_connection(path: Path) -> socket.socket:
    """A bare connection; a blocking connect waits while the daemon's accept backlog is full
    (a non-blocking one fails with EAGAIN on a Unix socket)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    s.settimeout(PATIENCE)
    return s


def connect(path: Path) -> socket.socket:
    """A bare connection; retried (within PATIENCE) while the daemon's accept backlog is full."""
    deadline = time.monotonic() + PATIENCE
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(PATIENCE)
        try:
            s.connect(str(path))
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise AssertionError("the daemon accepts no connection") from None
            time.sleep(0.01)


def read_until_eof(s: socket.socket) -> bytes:
    """Everything the daemon sends until it closes the connection."""
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def read_frame(s: socket.socket) -> bytes:
    """One frame's body from a bare connection."""

    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            assert chunk, "connection closed"
            buf += chunk
        return buf

    return exact(HEADER.unpack(exact(4))[0])


def daemon_stats(daemon: Daemon) -> dict[str, Any]:
    """The ``daemon`` part of the daemon's stats."""
    with Client(daemon.socket, timeout=PATIENCE) as c:
        figures: dict[str, Any] = c.stats()["daemon"]
        return figures


def ping_from_child(path: Path) -> Callable[[], str]:
    """What :func:`~tests.support.procs.run_as` runs to use the daemon as another user."""

    def ping() -> str:
        with Client(path, timeout=30.0, retries=1) as c:
            ns = unique_ns("other-user")
            claim = c.claim("k", namespace=ns)
            return f"pong {c.ping()} {claim.outcome.value}"

    return ping


def _lab() -> Iterator[Lab]:
    lab = Lab()
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture
def lab() -> Iterator[Lab]:
    """Daemons, children and directories that live for one test."""
    yield from _lab()


@pytest.fixture(scope="module")
def module_lab() -> Iterator[Lab]:
    """Daemons, children and directories shared by one test module."""
    yield from _lab()


@pytest.fixture(scope="module")
def daemon(module_lab: Lab) -> Daemon:
    """One daemon shared by a module (tests keep apart by namespace)."""
    return module_lab.daemon()
