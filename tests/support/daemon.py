"""Fixtures that run ``dedupcore serve`` and client processes as real subprocesses.

Every daemon lives in its own short temporary directory (``/tmp/dcXXXX``):
a Unix socket path must stay under 108 bytes, which pytest's ``tmp_path``
does not guarantee. Daemons and child processes are always stopped in the
fixture's teardown, whatever the test did to them.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dedupcore.client import Client
from dedupcore.errors import DedupError

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "daemon" / "child.py"
#: Generous bound for anything that should happen "soon" on a loaded machine.
PATIENCE = 90.0


def child_env() -> dict[str, str]:
    """The environment of every subprocess: this checkout first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.pop("DEDUPCORE_SOCKET", None)
    env.pop("DEDUPCORE_DATA", None)
    return env


def unique_ns(prefix: str = "t") -> str:
    """A namespace no other test uses."""
    return f"{prefix}/{uuid.uuid4().hex}"


class Daemon:
    """One ``dedupcore serve`` process (restartable on the same data and socket)."""

    def __init__(self, home: Path, data: Path, socket: Path, args: Sequence[str]) -> None:
        self.home = home
        self.data = data
        self.socket = socket
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = home / "daemon.log"
        self.runs = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "dedupcore",
            "serve",
            "--data",
            str(self.data),
            "--socket",
            str(self.socket),
            *self.args,
        ]

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

    def close(self) -> None:
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


class ChildProc:
    """A ``child.py`` process: JSON config in argv, commands on stdin, lines on stdout."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def next_line(self, timeout: float = PATIENCE) -> str | None:
        """The next stdout line, or None at end of output."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"child {self.config.get('mode')} said nothing for {timeout} s; stderr:\n"
                + "".join(self.stderr)[-4000:]
            ) from None

    def expect(self, prefix: str, timeout: float = PATIENCE) -> str:
        """Skips lines until one starting with ``prefix``; returns the rest of it."""
        while True:
            line = self.next_line(timeout)
            if line is None:
                raise AssertionError(
                    f"child ended before {prefix!r}; rc={self.proc.poll()} stderr:\n"
                    + "".join(self.stderr)[-4000:]
                )
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def expect_json(self, prefix: str, timeout: float = PATIENCE) -> Any:
        return json.loads(self.expect(prefix, timeout))

    def rest(self, timeout: float = PATIENCE) -> list[str]:
        """Every remaining line until the child's output ends."""
        out = []
        while (line := self.next_line(timeout)) is not None:
            out.append(line)
        return out

    def wait(self, timeout: float = PATIENCE) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()


class Lab:
    """Makes short temporary directories, daemons and child processes; cleans all up."""

    def __init__(self) -> None:
        self.dirs: list[Path] = []
        self.daemons: list[Daemon] = []
        self.children: list[ChildProc] = []

    def tmpdir(self) -> Path:
        d = Path(tempfile.mkdtemp(prefix="dc"))
        self.dirs.append(d)
        return d

    def daemon(
        self,
        *args: str,
        data: Path | None = None,
        socket: Path | None = None,
        start: bool = True,
    ) -> Daemon:
        """A daemon in a fresh directory (``data``/``socket`` override the defaults)."""
        home = self.tmpdir()
        d = Daemon(home, data or home / "data", socket or home / "s" / "d.sock", args)
        self.daemons.append(d)
        if start:
            d.start()
        return d

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
            c.kill()
        for d in self.daemons:
            d.close()
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def lab() -> Iterator[Lab]:
    """Daemons, children and directories that live for one test."""
    lab = Lab()
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="module")
def module_lab() -> Iterator[Lab]:
    """Daemons, children and directories shared by one test module."""
    lab = Lab()
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="module")
def daemon(module_lab: Lab) -> Daemon:
    """One daemon shared by a module (tests keep apart by namespace)."""
    return module_lab.daemon()


@pytest.fixture
def ns() -> str:
    """A namespace of this test alone."""
    return unique_ns()
